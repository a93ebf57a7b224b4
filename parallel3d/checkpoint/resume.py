"""The resume decision: which checkpoint a run continues from, verified how, the fallback, and
what the new config changes about it (``restore``, called once by train.py).

A checkpoint restores state (weights, optimizer moments, RNG, data position, the step); the
config decides everything else, the learning-rate schedule included (optim.set_schedule_step).
Before any rank loads anything, the ranks check each candidate together (checkpoint/verify.py):
each checks every n-th file and block, one all-gather of what they found gives every rank the
same verdict at the same time, so all load the same checkpoint or all stop. Under ``checksum``
the shards' blocks are hashed by the load as it reads them (checkpoint/reader.py), each byte read
once; a mismatch there is damage like any other. A corrupt newest checkpoint is skipped for the
newest one that verifies, with one line naming the file, instead of failing deep inside DCP.
"""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from parallel3d.base import ConfigError, RunError
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.commit import META, complete_steps, find_checkpoint
from parallel3d.checkpoint.errors import CheckpointError, failure_line, mismatch_of
from parallel3d.checkpoint.manifest import MANIFEST, gathered
from parallel3d.checkpoint.state import TrainState
from parallel3d.checkpoint.unfinished import settle_unfinished
from parallel3d.checkpoint.verify import check_hf_weights, checkpoint_problem
from parallel3d.config import hf_folder
from parallel3d.config.hf_folder import loaded_line
from parallel3d.config.schema import Config
from parallel3d.data.tokenizer import tokenizer_hash
from parallel3d.models import Transformer, num_params

# Keys that differ between any two starts and say nothing about training.
UNCOMPARED = ("run_dir", "checkpoint.resume", "checkpoint.init_from", "checkpoint.create_seed")


@dataclass
class Start:
    """Where a run starts: the step done, the data offset (which includes any data a rollback
    skipped), and the bad-step guard's saved counts."""

    step: int = 0
    data_offset: int = 0
    guard: dict = field(default_factory=dict)


def restore(*, checkpointer: Checkpointer, state: TrainState, c: Config, announce: bool, config_yaml: str) -> Start:
    """Resume (or load initial weights) as checkpoint.* says: the one place a run decides which
    checkpoint it continues from, verified how, and what its config changes."""
    settle_unfinished(root=checkpointer.root, verify=c.checkpoint.verify, resume=c.checkpoint.resume,
                      announce=announce)

    def checked(path: Path) -> None:  # the chosen checkpoint against this run, before it is loaded
        check_not_past_end(path, c.train.steps)
        check_tokenizer(path, c.data, announce=announce)
        if announce:
            report_changes(path, config_yaml)

    found = load_verified(checkpointer=checkpointer, state=state, resume=c.checkpoint.resume,
                          verify=c.checkpoint.verify, announce=announce, before_load=checked)
    if found is not None:
        path, meta = found
        step = 0 if meta["model_only"] else meta["step"]
        if announce:
            print(f"parallel3d: resumed from {path} (saved at {meta['layout']})", flush=True)
            if step == c.train.steps:
                print(f"parallel3d: {path.name} is at train.steps={step}: the run is complete, nothing to train "
                      f"(raise train.steps to continue it; to evaluate it: parallel3d-evaluate {path} "
                      f"eval.sources=[...])", flush=True)
        if meta["model_only"]:  # a seed checkpoint: its weights, then a fresh start
            return Start()
        return Start(meta["step"], meta["samples_seen"] - meta["step"] * c.train.global_batch_size,
                     meta.get("guard", {}))
    if c.checkpoint.init_from:
        init_from = Path(c.checkpoint.init_from).expanduser()
        if hf_folder.is_hf_dir(init_from):
            check_hf_weights(init_from)
        else:
            verify_init_from(init_from, c.checkpoint.verify, announce=announce)
        checkpointer.load_weights(init_from, state, c.model)
        if announce and hf_folder.is_hf_dir(init_from):
            with torch.device("meta"):
                size = num_params(Transformer(c.model))
            print(loaded_line(init_from, n_params=size, tokenizer=c.data.tokenizer), flush=True)
    return Start()


def pick_checkpoint(root: Path, resume: str, announce: bool, *, verify: str = "checksum",
                    hashed_at_load: bool = False, rejected: dict[Path, str] | None = None) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names, verified. Under ``auto`` a corrupt newest one is
    skipped for the newest one that verifies (said on the console when ``announce``); a named one
    that fails is refused. Collective when a process group is up: rank 0 checks, every rank gets
    its verdict (the same path, or the same CheckpointError). ``hashed_at_load``: the shards'
    blocks are left to the load (load_verified); ``rejected``: checkpoints a load found damaged."""
    group = dist.group.WORLD if dist.is_initialized() else None
    check = functools.partial(checkpoint_problem, group=group, shards_hashed_at_load=hashed_at_load)
    return _decided_together(lambda: _pick(root, resume, announce, verify, check, rejected or {}), root, group)


def load_verified(*, checkpointer: Checkpointer, state: TrainState, resume: str, verify: str,
                  announce: bool, before_load=None) -> tuple[Path, dict] | None:
    """The checkpoint ``resume`` names (pick_checkpoint), loaded into ``state``: (its path, its
    meta.json), or None when there is none. Under ``checksum`` each shard block is hashed as the
    load reads it (each byte read once); a mismatch falls back to the previous checkpoint like
    any damage pick_checkpoint finds. ``before_load(path)``: checks of the chosen checkpoint."""
    rejected: dict[Path, str] = {}
    while True:
        path = pick_checkpoint(checkpointer.root, resume, announce, verify=verify, hashed_at_load=True,
                               rejected=rejected)
        if path is None:
            return None
        if before_load is not None:
            before_load(path)
        try:
            return path, checkpointer.load(path, state, hash_shards=verify == "checksum")
        except CheckpointError as e:
            line = mismatch_of(e)
            if line is None:
                raise
            if resume != "auto":
                raise CheckpointError(f"checkpoint.resume={resume}: {line}. Fix: name an earlier checkpoint",
                                      every_rank=True) from e
            _skipping(path, line, announce)
            rejected[path] = line


def _skipping(path: Path, problem: str, announce: bool) -> None:
    if announce:
        print(f"parallel3d: skipping corrupt checkpoint {path}: {problem}; trying the previous one",
              file=sys.stderr, flush=True)


def _decided_together(decide, path: Path, group):
    """``decide()`` on every rank (its checks share the reading out, checkpoint_problem); every
    rank returns the same result or raises the same CheckpointError, the first failing rank's."""
    try:
        verdict = (None, decide())
    except RunError as e:
        verdict = (str(e), None)
    except OSError as e:
        verdict = (failure_line(e, path, saving=False), None)
    failures = [failure for failure, _ in gathered(verdict, group) if failure]
    if failures:
        raise CheckpointError(failures[0], every_rank=True)
    return verdict[1]


def _pick(root: Path, resume: str, announce: bool, verify: str, check, rejected: dict[Path, str]) -> Path | None:
    if resume == "none":
        return None
    if resume != "auto":
        path = find_checkpoint(Path(resume).expanduser())
        if path is None:
            raise RunError(f"checkpoint.resume={resume}: no complete checkpoint there. Fix: name a step_<N> "
                           f"folder, a checkpoints/ folder or a run_dir, or use checkpoint.resume=auto")
        problem = check(path, verify)
        if problem:
            raise RunError(f"checkpoint.resume={resume}: {problem}. Fix: name an earlier checkpoint")
        _warn_unverified(path, verify, announce)
        return path
    problems = []
    for step in reversed(complete_steps(root)):
        path = root / f"step_{step}"
        if path in rejected:  # said when its load found it
            problems.append(rejected[path])
            continue
        problems.append(check(path, verify))
        if problems[-1] is None:
            _warn_unverified(path, verify, announce)
            return path
        _skipping(path, problems[-1], announce)
    if problems:  # never a silent fresh start over a run whose checkpoints are all damaged
        raise RunError(f"every checkpoint in {root} is corrupt (newest: {problems[0]}). Fix: "
                       f"checkpoint.resume=none to start afresh (the old run is moved aside)")
    return None


def verify_init_from(path: Path, verify: str, announce: bool) -> None:
    """``checkpoint.init_from`` of one of our checkpoints: refused unless it verifies (collective)."""
    group = dist.group.WORLD if dist.is_initialized() else None

    def decide() -> None:
        found = find_checkpoint(path)
        problem = checkpoint_problem(found, verify, group=group) if found is not None else None
        if problem:
            raise RunError(f"checkpoint.init_from={path}: {problem}. Fix: write the seed checkpoint again")
        if found is not None:
            _warn_unverified(found, verify, announce)

    _decided_together(decide, path, group)


def _warn_unverified(path: Path, verify: str, announce: bool) -> None:
    if announce and verify != "none" and not (path / MANIFEST).is_file():
        print(f"parallel3d: warning: {path} has no {MANIFEST} (written before checkpoints had manifests): "
              f"its files cannot be verified", file=sys.stderr, flush=True)


def check_not_past_end(path: Path, steps: int) -> int:
    """The step of checkpoint ``path``; refuses one past ``train.steps`` (nothing would train)."""
    meta = json.loads((path / META).read_text())
    if meta["model_only"]:
        return 0
    if meta["step"] > steps:
        raise RunError(f"checkpoint {path} is at step {meta['step']}, past train.steps={steps}: nothing to train. "
                       f"Fix: set train.steps above {meta['step']}, or checkpoint.resume=none to start afresh "
                       f"(the old run is moved aside)")
    return meta["step"]


def config_changes(saved_yaml: str, current_yaml: str) -> list[str]:
    """``key old -> new`` for every value the current config changes against the checkpoint's."""
    old, new = _flatten(yaml.safe_load(saved_yaml) or {}), _flatten(yaml.safe_load(current_yaml) or {})
    keys = sorted(k for k in old.keys() | new.keys() if k not in UNCOMPARED and old.get(k) != new.get(k))
    return [f"{k} {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in keys]


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def report_changes(path: Path, current_yaml: str) -> None:
    """Print what this start changes against checkpoint ``path``'s config (rank 0 calls it)."""
    saved = path / "config.yaml"
    if not saved.is_file():
        return
    changes = config_changes(saved.read_text(), current_yaml)
    if changes:
        print(f"parallel3d: resuming {path.name} with a changed config (it applies from the next step): "
              f"{', '.join(changes)}", flush=True)


def check_tokenizer(path: Path, data_cfg, announce: bool) -> None:
    """Refuse to resume checkpoint ``path`` with another tokenizer than it was trained with (its
    embeddings would index other tokens) unless ``data.allow_tokenizer_change``. The tokenizer is
    its file's hash, recorded in meta.json; older checkpoints are judged by their config.yaml."""
    meta = json.loads((path / META).read_text())
    if meta.get("model_only"):  # a seed checkpoint: initial weights, trained on nothing yet
        return
    current = tokenizer_hash(data_cfg.tokenizer)
    saved = meta.get("tokenizer") or _saved_tokenizer_hash(path, data_cfg.tokenizer, current)
    if saved is None or saved == current:
        return
    what = (f"{path} was trained with tokenizer {_short(saved)}, data.tokenizer={data_cfg.tokenizer} is "
            f"{_short(current)}")
    if data_cfg.allow_tokenizer_change:
        if announce:
            print(f"parallel3d: warning: {what} (data.allow_tokenizer_change=true)", file=sys.stderr, flush=True)
        return
    raise ConfigError("data.tokenizer", data_cfg.tokenizer, f"another tokenizer than the checkpoint's ({what}): "
                      f"its embeddings index other tokens", "resume with the checkpoint's tokenizer, or set "
                      "data.allow_tokenizer_change=true if the change is meant (a remapped vocabulary)")


def _short(tokenizer: str) -> str:
    return f"sha256 {tokenizer[:12]}" if len(tokenizer) == 64 else tokenizer


def _saved_tokenizer_hash(path: Path, spec: str, current: str) -> str | None:
    """The hash of the tokenizer a checkpoint without one in meta.json names in its config.yaml:
    its file's, if still there; None when nothing can be told."""
    try:
        saved_spec = (yaml.safe_load((path / "config.yaml").read_text()) or {})["data"]["tokenizer"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if saved_spec == spec:
        return current
    try:
        return tokenizer_hash(saved_spec)
    except OSError:  # moved or gone: another path may hold the same file; nothing to compare with
        return f"{saved_spec} (file not found)"
