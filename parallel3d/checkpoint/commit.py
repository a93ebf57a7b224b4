"""The commit protocol: what makes a step folder a checkpoint, and what removes one.

A save writes every rank's files, then rank 0 writes ``meta.json``, the manifest (every file's
size and hashes) and last the empty ``COMPLETE`` marker, each atomically (a temporary name, fsync,
rename). Only a folder with its marker is loaded; ``keep_last`` removes older ones only once the
new one is committed and its files match the manifest, each marker first. A folder found without
its marker is settled at the next start by checkpoint/unfinished.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from parallel3d.checkpoint.errors import CheckpointError
from parallel3d.checkpoint.manifest import MANIFEST, verify_manifest, write_manifest

COMPLETE, META = "COMPLETE", "meta.json"
SHARD = "shard-{:05d}-"  # the start of rank r's file name: DCP's HuggingFaceStorageWriter numbers them r + 1
STEP_DIR = re.compile(r"^step_(\d+)$")


def complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    found = (STEP_DIR.match(p.name) for p in root.iterdir() if (p / COMPLETE).is_file())
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


def own_files(path: Path, rank: int) -> list[Path]:
    """The files rank ``rank`` wrote: its RNG state and its shards. Raises when one is not there."""
    rng = path / "rng" / f"rank_{rank}.safetensors"
    shards = sorted(path.glob(SHARD.format(rank + 1) + "*.safetensors"))
    missing = f"rng/{rng.name}" if not rng.is_file() else None if shards else f"{SHARD.format(rank + 1)}*.safetensors"
    if missing:
        raise CheckpointError(f"saving {path} failed: rank {rank}'s {missing} was not written. Fix: check the file "
                              f"system; the previous checkpoint is intact and the run resumes from it")
    return [rng, *shards]


def commit(path: Path, *, meta: dict, entries: list[dict[str, dict]]) -> None:
    """Rank 0, once every rank has written and hashed its files (``entries``, one per rank):
    meta.json, the manifest (rank 0 hashes what no rank did: meta.json, config.yaml), COMPLETE."""
    write_atomic(path / META, json.dumps(meta, indent=2))
    hashed = {name: entry for own in entries for name, entry in own.items()}
    write_manifest(path, [p for p in path.rglob("*") if p.is_file()], entries=hashed)
    write_atomic(path / COMPLETE, "")


def rotate(path: Path, keep_last: int) -> None:
    """Older checkpoints go only once ``path`` is committed and its files match the manifest."""
    if keep_last > 0 and verify_manifest(path, "size", ignore=[COMPLETE]) is None:
        for old in complete_steps(path.parent)[: -keep_last]:
            remove_checkpoint(path.parent / f"step_{old}")


def remove_checkpoint(path: Path) -> None:
    """Delete checkpoint ``path``, its COMPLETE marker first, then its manifest (made durable): a
    kill in the middle leaves a folder whose meta.json promises a manifest it lacks, removed at the
    next start (checkpoint/unfinished.py), never a complete one with files missing."""
    (path / COMPLETE).unlink(missing_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    shutil.rmtree(path, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
