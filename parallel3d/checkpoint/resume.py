"""Which checkpoint a run continues from, and what the new config changes about it.

A checkpoint restores state (weights, optimizer moments, RNG, data position, the step); the
config decides everything else, the learning-rate schedule included (optim.set_schedule_step).
Before any rank loads anything, the ranks check each candidate together (meta.json parses, every
safetensors file is as long as its header says, and every file matches the checkpoint's
manifest.json as ``checkpoint.verify`` says): each checks every n-th file and block, one
all-gather of what they found gives every rank the same verdict at the same time, so all load
the same checkpoint or all stop. A corrupt newest checkpoint is skipped for the newest one that
verifies, with one line naming the file, instead of failing deep inside DCP with a traceback.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import torch.distributed as dist
import yaml

from parallel3d.base import ConfigError, RunError
from parallel3d.checkpoint.commit import COMPLETE, META, complete_steps, find_checkpoint
from parallel3d.checkpoint.errors import CheckpointError, failure_line
from parallel3d.checkpoint.manifest import MANIFEST, ManifestMissing, first_problem, gathered, share_problem
from parallel3d.data.tokenizer import tokenizer_hash

# Keys that differ between any two starts and say nothing about training.
UNCOMPARED = ("run_dir", "checkpoint.resume", "checkpoint.init_from", "checkpoint.create_seed")


def checkpoint_problem(path: Path, verify: str = "checksum", *, group=None) -> str | None:
    """What is wrong with the files of checkpoint ``path``, or None. ``verify``: how its files are
    checked against its manifest (``checksum``, ``size``, ``none``); one written before manifests
    existed gets the structural checks alone. ``group``: a process group whose ranks share the
    reading (each every n-th file and block) and all return the same answer (one all-gather)."""
    share = (group.rank(), group.size()) if group is not None else (0, 1)
    manifest = share_problem(path, verify, ignore=[COMPLETE], share=share) if verify != "none" else None
    found = gathered((manifest, _structure_problem(path, share)), group)
    try:
        problem = first_problem(path, [m for m, _ in found])
    except ManifestMissing:
        problem = None
    structure = sorted(s for _, s in found if s is not None)
    return problem or (structure[0][-1] if structure else None)


def _structure_problem(path: Path, share: tuple[int, int]) -> tuple[int, str] | None:
    """This rank's share of the structural checks: (order, line) of the first problem, or None."""
    index, count = share
    shards = sorted(path.rglob("*.safetensors"))
    if index == 0:
        try:
            meta = json.loads((path / META).read_text())
            if not {"step", "model_only"} <= meta.keys():
                return -2, f"{path / META} lacks step or model_only"
        except (OSError, ValueError) as e:
            return -2, f"{path / META} is unreadable ({type(e).__name__})"
        if not [s for s in shards if s.parent == path]:
            return -1, f"{path} has no shard-*.safetensors file"
    for order in range(index, len(shards), count):
        try:
            problem = safetensors_problem(shards[order])
        except OSError as e:
            problem = f"is unreadable ({e.strerror or type(e).__name__})"
        if problem:
            return order, f"{shards[order]} {problem}"
    return None


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors' bytes: the
    header's largest end offset must be exactly where the file ends."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if 8 + length > size:
                return f"is truncated ({size} bytes, header alone says {8 + length})"
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        return f"has a corrupt header ({type(e).__name__})"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"is {size} bytes, its header says {expected} (truncated or overwritten)"
    return None


def pick_checkpoint(root: Path, resume: str, announce: bool, *, verify: str = "checksum") -> Path | None:
    """The checkpoint ``checkpoint.resume`` names, verified. Under ``auto`` a corrupt newest one is
    skipped for the newest one that verifies (said on the console when ``announce``); a named one
    that fails is refused. Collective when a process group is up: rank 0 checks, every rank gets
    its verdict (the same path, or the same CheckpointError)."""
    group = dist.group.WORLD if dist.is_initialized() else None
    return _decided_together(lambda: _pick(root, resume, announce, verify, group), root, group)


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


def _pick(root: Path, resume: str, announce: bool, verify: str, group) -> Path | None:
    if resume == "none":
        return None
    if resume != "auto":
        path = find_checkpoint(Path(resume).expanduser())
        if path is None:
            raise RunError(f"checkpoint.resume={resume}: no complete checkpoint there. Fix: name a step_<N> "
                           f"folder, a checkpoints/ folder or a run_dir, or use checkpoint.resume=auto")
        problem = checkpoint_problem(path, verify, group=group)
        if problem:
            raise RunError(f"checkpoint.resume={resume}: {problem}. Fix: name an earlier checkpoint")
        _warn_unverified(path, verify, announce)
        return path
    problems = []
    for step in reversed(complete_steps(root)):
        path = root / f"step_{step}"
        problems.append(checkpoint_problem(path, verify, group=group))
        if problems[-1] is None:
            _warn_unverified(path, verify, announce)
            return path
        if announce:
            print(f"parallel3d: skipping corrupt checkpoint {path}: {problems[-1]}; trying the previous one",
                  file=sys.stderr, flush=True)
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


def check_hf_weights(path: Path) -> None:
    """Every safetensors file a Hugging Face folder's index names is there and whole."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise RunError(f"{index} is corrupt ({type(e).__name__}). Fix: download the model again") from e
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    for name in names:
        shard = path / name
        problem = "is missing" if not shard.is_file() else safetensors_problem(shard)
        if problem:
            raise RunError(f"checkpoint.init_from={path}: {shard} {problem}. Fix: download the model again")
