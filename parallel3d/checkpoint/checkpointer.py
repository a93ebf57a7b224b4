"""Checkpoints with torch.distributed.checkpoint (DCP): saved at any layout, loaded at any other.

``run_dir/checkpoints/step_<N>/`` holds:

    shard-*.safetensors        every rank's shards of the model and optimizer state, written by
                               DCP's HuggingFaceStorageWriter (offsets in each file's header)
    rng/rank_<r>.safetensors   each rank's RNG states
    meta.json                  step, data position, LR scheduler (for reference: a resumed run
                               takes its schedule from its config), the layout it was saved at
    config.yaml                the resolved config of the run that saved it
    manifest.json              every file above with its size and XXH3 hashes (parallel3d/checkpoint/manifest.py),
                               checked before a resume loads anything (resume.pick_checkpoint)
    COMPLETE                   written last: a folder without it is ignored, then removed

Keys do not depend on the layout: a parameter is saved under its full-model name
(``layers.3.attention.wq.weight``) and each optimizer state tensor as ``optimizer/<name>/<state>``
in the parameter's global shape, so DCP reshards both to whatever dp/tp/pp the loader runs.
Nothing is unpickled on load: tensors and their sharding come from safetensors, the rest from JSON.

A save refuses a model or optimizer holding NaN or Inf (every rank checks its shards, one
all-reduce decides), so no non-finite checkpoint exists; ``keep_last`` removes older checkpoints
only once the new one is committed with its manifest. Failures are one-line CheckpointErrors
(checkpoint/errors.py), raised on every rank together where the ranks can agree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from parallel3d.base import rank
from parallel3d.checkpoint.errors import CheckpointError, NonFiniteState, checkpoint_errors, nonfinite_names
from parallel3d.checkpoint.manifest import file_entries, verify_manifest, write_manifest
from parallel3d.config import hf_folder
from parallel3d.config.schema import CheckpointConfig
from parallel3d.hf import families
from parallel3d.models.lora import is_adapter
from parallel3d.optim.adamw import init_optimizer_state
from parallel3d.optim.schedule import set_schedule_step
from parallel3d.progress import Progress

COMPLETE, META = "COMPLETE", "meta.json"
_SHARD = "shard-{:05d}-"  # the start of rank r's file name: DCP's HuggingFaceStorageWriter numbers them r + 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainState:
    """What a checkpoint saves and restores: this rank's model parts, optimizer and LR schedule."""

    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Full-model names, in the optimizer's order. A tied copy on a second part repeats a name."""
        return [(name, p) for part in self.parts for name, p in part.named_parameters()]

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """State that is not a parameter but is trained (the sigmoid MoE router's balancing bias)."""
        return {f"{prefix}.{name}": buf for part in self.parts for prefix, module in part.named_modules()
                for name, buf in module._buffers.items()
                if buf is not None and name not in module._non_persistent_buffers_set}


def complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    found = (_STEP_DIR.match(p.name) for p in root.iterdir() if (p / COMPLETE).is_file())
    return sorted(int(m.group(1)) for m in found if m)


def find_checkpoint(path: Path) -> Path | None:
    """The newest complete checkpoint at ``path``: a step folder, a checkpoints/ folder or a run_dir."""
    if (path / COMPLETE).is_file():
        return path
    for root in (path / "checkpoints", path):
        steps = complete_steps(root)
        if steps:
            return root / f"step_{steps[-1]}"
    return None


def _model_targets(state: TrainState, keys=lambda name, param: {name: param}) -> tuple[dict, list]:
    """DCP load targets: one tensor per key (loaded in place), and the duplicates to copy it into.
    ``keys``: the stored keys of a parameter and the tensors (it, or views of it) they load into."""
    targets, copies = {}, []
    for name, param in state.named_parameters():
        for key, target in keys(name, param.detach()).items():
            if key in targets:
                copies.append((target, targets[key]))
            else:
                targets[key] = target
    return targets, copies


def _optimizer_entries(state: TrainState):
    """(key, state tensor) for each tensor of the optimizer state, keyed by its parameter's name
    (found by identity: the optimizer's groups, decay and no decay, order parameters otherwise)."""
    name_of = {id(p): name for name, p in state.named_parameters() if p.requires_grad}  # LoRA's base is frozen
    optimizer_params = [q for group in state.optimizer.param_groups for q in group["params"]]
    assert len(optimizer_params) == len(name_of), "the optimizer must hold exactly the parts' trainable parameters"
    for q in optimizer_params:
        name = name_of[id(q)]
        for key, value in state.optimizer.state.get(q, {}).items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer/{name}/{key}", value


def state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    tensors = {name: p.detach() for name, p in state.named_parameters()} | state.persistent_buffers()
    if state.optimizer is not None:
        tensors.update(_optimizer_entries(state))
    return tensors


class Checkpointer:
    """Saves, finds and loads this run's checkpoints; one per run, on every rank."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, timeout=None, progress: Progress | None = None):
        self.root, self.cfg = run_dir / "checkpoints", cfg
        # Reports "saving step_N" / "saved"; silent unless given (training passes rank 0's display).
        self.progress = progress if progress is not None else Progress(enabled=False)
        self.rank = rank()
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # A group of its own: an asynchronous save coordinates ranks while training uses the default one.
        self.group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        # poll() asks every rank whether its asynchronous save is done on a group of its own: the
        # save's thread may be in a collective over self.group at that moment.
        self._poll_group = (dist.new_group(backend="gloo", timeout=timeout)
                            if dist.is_initialized() and cfg.async_save else None)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") if cfg.async_save else None
        self._pending = None  # (future of this rank's manifest entries, path, meta) of an asynchronous save

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def remove_incomplete(self) -> list[Path]:
        """Partial checkpoints left by a kill: never loaded, removed before this run saves.
        Returns them (on rank 0) for the run to report."""
        removed = []
        if self.rank == 0 and self.root.is_dir():
            for path in sorted(self.root.iterdir()):
                if _STEP_DIR.match(path.name) and not (path / COMPLETE).is_file():
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        self._barrier()
        return removed

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: TrainState, meta: dict, config_yaml: str) -> None:
        """Write step ``step``; synchronous unless checkpoint.async_save (then finished later).
        Raises NonFiniteState, writing nothing, when any rank's shards hold NaN or Inf."""
        self.wait()  # one save in flight at a time
        path = self.root / f"step_{step}"
        tensors = state_dict(state)
        self._refuse_nonfinite(step, tensors)
        self.progress.saving(path.name)
        self._agree(path, lambda: self._prepare(path, config_yaml))
        self._agree(path, lambda: self._save_rng(path))
        meta = {**meta, "step": step, "world_size": self.world_size, "model_only": state.optimizer is None,
                "scheduler": _scheduler_state(state.scheduler)}
        writer = HuggingFaceStorageWriter(str(path), save_distributed=True)
        with self._discarded_on_failure(path):
            if self.cfg.async_save:
                # DCP stages a CPU copy first, so training may change the tensors while it writes.
                written = dcp.async_save(tensors, storage_writer=writer, process_group=self.group,
                                         no_dist=self.group is None)
                # Then, still off the training thread, this rank hashes the files it wrote.
                self._pending = (self._hasher.submit(self._hash_own, path, written), path, meta)
                return
            dcp.save(tensors, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
        entries = self._agree(path, lambda: self._hash_own(path))
        self._agree(path, lambda: self._commit(path, meta, entries))

    def poll(self) -> None:
        """Commit an asynchronous save once every rank has written and hashed its files. While one is
        in flight, that costs one all-reduce of a flag per call (per step): the ranks see their saves
        finish at different steps, and must commit, or fail, at the same one."""
        if self._pending is None:
            return
        done = torch.tensor([int(self._pending[0].done())])
        if self._poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if done.item():
            self.wait()

    def wait(self) -> None:
        """Finish the asynchronous save in flight: every rank waits for its own write and hashes,
        then all commit together (or all raise the same one-line error)."""
        if self._pending is not None:
            hashed, path, meta = self._pending
            self._pending = None
            entries = self._agree(path, hashed.result)
            self._agree(path, lambda: self._commit(path, meta, entries))

    def _refuse_nonfinite(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Every rank checks its shards; one all-reduce of the count decides for all."""
        bad = nonfinite_names(tensors)
        count = torch.tensor([len(bad)])
        if self.group is not None:
            dist.all_reduce(count, group=self.group)
        if count.item():
            steps = complete_steps(self.root)
            kept = f"step_{steps[-1]} stays the newest checkpoint" if steps else "there is no earlier checkpoint"
            first = f", {bad[0]} among them" if bad else ""
            raise NonFiniteState(f"step {step}: {count.item()} tensor shards of the model or optimizer hold NaN or "
                                 f"Inf{first}: not saved, {kept}. Fix: lower optim.lr, raise optim.warmup_steps "
                                 f"or set train.grad_clip", every_rank=True)

    def _prepare(self, path: Path, config_yaml: str) -> None:
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)  # a partial folder from an earlier, killed attempt
            (path / "rng").mkdir(parents=True)
            (path / "config.yaml").write_text(config_yaml)

    def _save_rng(self, path: Path) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        save_file(rng, str(path / "rng" / f"rank_{self.rank}.safetensors"))

    def _agree(self, path: Path, action) -> list:
        """Run ``action`` on every rank; returns every rank's result, in rank order. When it failed on
        any, every rank raises that failure's line (none is left waiting in a collective for a rank
        that has given up)."""
        error, result = None, None
        try:
            with checkpoint_errors(path, saving=True):
                result = action()
        except CheckpointError as e:
            error = e
        outcomes = [(str(error) if error else None, result)]
        if self.group is not None:
            outcomes = [None] * self.world_size
            dist.all_gather_object(outcomes, (str(error) if error else None, result), group=self.group)
        failed = [(r, problem) for r, (problem, _) in enumerate(outcomes) if problem]
        if failed:
            self._discard(path)
            r, problem = failed[0]
            raise CheckpointError(problem if r == 0 else f"rank {r}: {problem}", every_rank=True) from error
        return [result for _, result in outcomes]

    @contextlib.contextmanager
    def _discarded_on_failure(self, path: Path):
        """A failed save leaves no partial folder taking space (a kill still may: removed at the next start)."""
        try:
            with checkpoint_errors(path, saving=True):
                yield
        except CheckpointError:
            self._discard(path)
            raise

    def _discard(self, path: Path) -> None:
        if self.rank == 0 and not (path / COMPLETE).exists():
            shutil.rmtree(path, ignore_errors=True)

    def _hash_own(self, path: Path, written=None) -> dict[str, dict]:
        """The manifest entries of the files this rank wrote (its shard, its RNG state), hashed here:
        every rank reads its own files once, in parallel, instead of rank 0 reading them all.
        ``written``: the asynchronous save's future, waited for first (this runs in its own thread)."""
        if written is not None:
            written.result()
        return file_entries(path, _own_files(path, self.rank))

    def _commit(self, path: Path, meta: dict, entries: list[dict[str, dict]]) -> None:
        """Rank 0, once every rank has written and hashed its files (``entries``, one per rank):
        meta.json, the manifest (rank 0 hashes what no rank did: meta.json, config.yaml), COMPLETE."""
        if self.rank != 0:
            return
        _write_atomic(path / META, json.dumps(meta, indent=2))
        hashed = {name: entry for own in entries for name, entry in own.items()}
        write_manifest(path, [p for p in path.rglob("*") if p.is_file()], entries=hashed)
        _write_atomic(path / COMPLETE, "")
        self.progress.saved(path.name)  # an async save: steps after it started, from poll() or wait()
        # Older checkpoints go only once this one is committed and its files match the manifest.
        if self.cfg.keep_last > 0 and verify_manifest(path, "size", ignore=[COMPLETE]) is None:
            for old in complete_steps(self.root)[: -self.cfg.keep_last]:
                remove_checkpoint(self.root / f"step_{old}")

    # -- loading --------------------------------------------------------------------------

    def load(self, path: Path, state: TrainState) -> dict:
        """Restore ``state`` from checkpoint ``path`` at this run's layout; returns its meta.json.
        ``path`` is trusted: resume.pick_checkpoint verifies it first."""
        with checkpoint_errors(path, saving=False, every_rank=True):
            return self._load(path, state)

    def _load(self, path: Path, state: TrainState) -> dict:
        meta = json.loads((path / META).read_text())
        targets, copies = _model_targets(state)
        targets |= state.persistent_buffers()
        if state.optimizer is not None and not meta["model_only"]:
            init_optimizer_state(state.optimizer)
            for key, value in _optimizer_entries(state):
                twin = targets.setdefault(key, value)  # set already: a tied copy's state, filled from its twin
                if twin is not value:
                    copies.append((value, twin))
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(path)), process_group=self.group,
                 no_dist=self.group is None)
        _finish_load(copies)
        if state.scheduler is not None and not meta["model_only"]:  # the config's schedule, at the saved step
            set_schedule_step(state.scheduler, meta["step"])
        rng_file = path / "rng" / f"rank_{self.rank}.safetensors"
        if meta["world_size"] == self.world_size and rng_file.is_file():  # RNG streams are per rank
            rng = load_file(str(rng_file))
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return meta

    def load_weights(self, path: Path, state: TrainState, model_cfg) -> None:
        """Initial weights only, from one of our checkpoints or a Hugging Face Llama folder."""
        if hf_folder.is_hf_dir(path):
            hf_folder.check_agrees(path, model_cfg)
            targets, copies = _model_targets(state, lambda name, param: families.base_hf_tensors(name, param, model_cfg))
            if families.exported_buffers(model_cfg):
                targets |= {key: t for name, buf in state.persistent_buffers().items()
                            for key, t in families.hf_tensors(name, buf, model_cfg).items()}
        else:
            found = find_checkpoint(path)
            if found is None:
                raise FileNotFoundError(f"checkpoint.init_from={path}: neither a checkpoint nor a Hugging Face folder")
            path = found
            targets, copies = _model_targets(state)
        # LoRA adapters start as LoRA does (B = 0) on whatever base is loaded: init_from gives the base.
        targets = {key: t for key, t in targets.items() if not is_adapter(key)}
        with checkpoint_errors(path, saving=False, every_rank=True):
            dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(path)), process_group=self.group,
                     no_dist=self.group is None)
        _finish_load(copies)


@contextlib.contextmanager
def _quiet_gathers():
    """Experts sharded twice along dim 0 (FSDP over expert_dp, then ep) take two all-gathers to
    collect, and DTensor warns that sequential collectives "may give inconsistent results between
    ranks": true of reductions, not of gathers, which copy. Drop that warning while gathering."""

    def keep(record: logging.LogRecord) -> bool:
        return "sequential all_gather" not in record.getMessage()

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


@torch.no_grad()
def _finish_load(copies) -> None:
    for dest, src in copies:
        dest.copy_(src)


def _scheduler_state(scheduler) -> dict | None:
    if scheduler is None:
        return None
    return scheduler.state_dict()  # plain numbers (a partial's lr_lambdas entry is its empty __dict__): JSON


def _own_files(path: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote: its RNG state and its shards. Raises when one is not there."""
    rng = path / "rng" / f"rank_{rank}.safetensors"
    shards = sorted(path.glob(_SHARD.format(rank + 1) + "*.safetensors"))
    missing = f"rng/{rng.name}" if not rng.is_file() else None if shards else f"{_SHARD.format(rank + 1)}*.safetensors"
    if missing:
        raise CheckpointError(f"saving {path} failed: rank {rank}'s {missing} was not written. Fix: check the file "
                              f"system; the previous checkpoint is intact and the run resumes from it")
    return [rng, *shards]


def remove_checkpoint(path: Path) -> None:
    """Delete checkpoint ``path``, its COMPLETE marker first (made durable): a kill in the middle
    leaves an incomplete folder, removed at the next start, never a complete one with files missing."""
    (path / COMPLETE).unlink(missing_ok=True)
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    shutil.rmtree(path, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def full_model_state(parts: list[nn.Module], pp_mesh) -> dict[str, torch.Tensor]:
    """The full weights of every stage (our names, on the CPU), gathered onto every rank of the stage's
    group: a collective. For small models and the end of a test run (the whole model in one rank's
    memory); large models are exported from a sharded checkpoint with ``parallel3d-convert-hf``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = {}
    for part in parts:  # full_state_dict gathers each stage's FSDP / TP shards (a collective)
        with _quiet_gathers():
            part_state = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
        full.update({k: v.detach().cpu() for k, v in part_state.items()})
    if pp_mesh is not None:
        stage_states = [None] * pp_mesh.size()
        dist.all_gather_object(stage_states, full, group=pp_mesh.get_group())
        full = {k: v for s in stage_states for k, v in s.items()}
    return full
