"""Whether a checkpoint folder's files can be trusted: its structure (meta.json, every safetensors
file as long as its header says) and its manifest (``checkpoint.verify``: sizes, or sizes and
checksums). Ranks of a process group share the reading and agree on one answer."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from parallel3d.base import RunError
from parallel3d.checkpoint.commit import COMPLETE, META
from parallel3d.checkpoint.manifest import ManifestMissing, first_problem, gathered, share_problem


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
