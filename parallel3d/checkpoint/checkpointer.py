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
    COMPLETE                   written last (checkpoint/commit.py): a folder without it is not loaded

Keys do not depend on the layout (checkpoint/state.py), so DCP reshards to whatever dp/tp/pp the
loader runs; ``checkpoint.init_from`` loads initial weights (checkpoint/init_from.py). Nothing is
unpickled on load: tensors and their sharding come from safetensors, the rest from JSON.

A save refuses a model or optimizer holding NaN or Inf (every rank checks its shards, one
all-reduce decides), so no non-finite checkpoint exists; ``keep_last`` removes older checkpoints
only once the new one is committed with its manifest. Failures are one-line CheckpointErrors
(checkpoint/errors.py), raised on every rank together where the ranks can agree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn

from parallel3d.base import rank
from parallel3d.checkpoint import commit as protocol
from parallel3d.checkpoint.commit import COMPLETE, META, complete_steps
from parallel3d.checkpoint.errors import CheckpointError, NonFiniteState, checkpoint_errors, nonfinite_names
from parallel3d.checkpoint.init_from import load_initial_weights
from parallel3d.checkpoint.manifest import MANIFEST, file_entries, read_manifest
from parallel3d.checkpoint.state import (TrainState, finish_load, model_targets, optimizer_entries, scheduler_state,
                                         state_dict)
from parallel3d.config.schema import CheckpointConfig
from parallel3d.optim.adamw import init_optimizer_state
from parallel3d.optim.schedule import set_schedule_step
from parallel3d.progress import Progress


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
        # "manifest": saved with one, so a copy that lost it is damaged, not a checkpoint from before manifests.
        meta = {**meta, "step": step, "world_size": self.world_size, "model_only": state.optimizer is None,
                "scheduler": scheduler_state(state.scheduler), "manifest": MANIFEST}
        import torch.distributed.checkpoint as dcp  # DCP (and DTensor with it): imported by runs that save

        writer = dcp.HuggingFaceStorageWriter(str(path), save_distributed=True)
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
        return file_entries(path, protocol.own_files(path, self.rank))

    def _commit(self, path: Path, meta: dict, entries: list[dict[str, dict]]) -> None:
        """Rank 0, once every rank has written and hashed its files (``entries``, one per rank):
        meta.json, the manifest (rank 0 hashes what no rank did: meta.json, config.yaml), COMPLETE."""
        if self.rank != 0:
            return
        protocol.commit(path, meta=meta, entries=entries)
        self.progress.saved(path.name)  # an async save: steps after it started, from poll() or wait()
        protocol.rotate(path, self.cfg.keep_last)

    # -- loading --------------------------------------------------------------------------

    def load(self, path: Path, state: TrainState, *, hash_shards: bool = False) -> dict:
        """Restore ``state`` from checkpoint ``path`` at this run's layout; returns its meta.json.
        ``path`` is verified first (resume.pick_checkpoint). ``hash_shards``: the shards' blocks
        after their first (which the pick verified, with ``hashed_at_load``) are hashed against the
        manifest as the load reads them (checkpoint/reader.py; a mismatch raises a CheckpointError
        caused by ChecksumMismatch on every rank, before its bytes are used)."""
        with checkpoint_errors(path, saving=False, every_rank=True):
            return self._load(path, state, hash_shards)

    def _load(self, path: Path, state: TrainState, hash_shards: bool) -> dict:
        meta = json.loads((path / META).read_text())
        targets, copies = model_targets(state)
        targets |= state.persistent_buffers()
        if state.optimizer is not None and not meta["model_only"]:
            init_optimizer_state(state.optimizer)
            for key, value in optimizer_entries(state):
                twin = targets.setdefault(key, value)  # set already: a tied copy's state, filled from its twin
                if twin is not value:
                    copies.append((value, twin))
        import torch.distributed.checkpoint as dcp

        from parallel3d.checkpoint.reader import VerifyingReader  # a DCP reader class: DCP's import with it

        reader = (VerifyingReader(str(path), read_manifest(path)) if hash_shards and (path / MANIFEST).is_file()
                  else dcp.HuggingFaceStorageReader(str(path)))
        dcp.load(targets, storage_reader=reader, process_group=self.group, no_dist=self.group is None)
        finish_load(copies)
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
        load_initial_weights(path=path, state=state, model_cfg=model_cfg, group=self.group)


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
