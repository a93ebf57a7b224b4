"""Whether a checkpoint folder's files can be trusted: its structure (meta.json, every safetensors
file as long as its header says) and its manifest (``checkpoint.verify``: sizes, or sizes and
checksums). Ranks of a process group share the reading and agree on one answer."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import yaml

from parallel3d.base import RunError
from parallel3d.checkpoint.commit import COMPLETE, META, SHARD
from parallel3d.checkpoint.manifest import MANIFEST, ManifestMissing, first_problem, gathered, share_problem


def checkpoint_problem(path: Path, verify: str = "checksum", *, group=None, shards_hashed_at_load: bool = False
                       ) -> str | None:
    """What is wrong with the files of checkpoint ``path``, or None. ``verify``: how its files are
    checked against its manifest (``checksum``, ``size``, ``none``). The structural checks hold at
    every level: meta.json, config.yaml and every safetensors header parse, every rank's shard is
    there (meta.json's world size) and the shards tile every tensor. One written before manifests
    existed gets those alone; one whose meta.json says it was saved with a manifest and that has
    none is damaged. ``group``: a process group whose ranks share the reading (each every n-th
    file and block) and all return the same answer (one all-gather). ``shards_hashed_at_load``:
    under ``checksum``, the shards' sizes and first blocks (their headers) are checked here and
    their other blocks hashed by the load that reads them (checkpoint/reader.py): each byte is
    read from the disk once."""
    share = (group.rank(), group.size()) if group is not None else (0, 1)
    later = "shard-*.safetensors" if shards_hashed_at_load else None
    manifest = share_problem(path, verify, ignore=[COMPLETE], share=share, hashed_later=later) \
        if verify != "none" else None
    found = gathered((manifest, _structure_problem(path, share)), group)
    structure = sorted(s for _, s in found if s is not None)
    try:
        problem = first_problem(path, [m for m, _ in found])
    except ManifestMissing:  # what is missing besides says more than the manifest's absence
        problem = None if structure or not _saved_with_manifest(path) else (
            f"{path / MANIFEST} is missing, but its meta.json says it was saved with one (a copy or sync that "
            f"dropped files?)")
    return problem or (structure[0][-1] if structure else None)


def _saved_with_manifest(path: Path) -> bool:
    try:
        return json.loads((path / META).read_text()).get("manifest") == MANIFEST
    except (OSError, ValueError, AttributeError):
        return False


def _structure_problem(path: Path, share: tuple[int, int]) -> tuple[int, str] | None:
    """This rank's share of the structural checks: (order, line) of the first problem, or None."""
    index, count = share
    shards = sorted(path.rglob("*.safetensors"))
    if index == 0 and (problem := _whole_problem(path, [s for s in shards if s.parent == path])):
        return problem
    for order in range(index, len(shards), count):
        try:
            problem = safetensors_problem(shards[order])
        except OSError as e:
            problem = f"is unreadable ({e.strerror or type(e).__name__})"
        if problem:
            return order, f"{shards[order]} {problem}"
    return None


def _whole_problem(path: Path, shards: list[Path]) -> tuple[int, str] | None:
    """meta.json and config.yaml parse, every rank saved its files, the shards tile every tensor."""
    try:
        meta = json.loads((path / META).read_text())
        if not isinstance(meta, dict) or not {"step", "model_only"} <= meta.keys():
            return -4, f"{path / META} lacks step or model_only"
    except (OSError, ValueError) as e:
        return -4, f"{path / META} is unreadable ({type(e).__name__})"
    try:
        if (path / "config.yaml").is_file() and not isinstance(yaml.safe_load((path / "config.yaml").read_text()),
                                                               (dict, type(None))):
            return -4, f"{path / 'config.yaml'} is not a config (not a mapping)"
    except (OSError, ValueError, yaml.YAMLError) as e:
        return -4, f"{path / 'config.yaml'} is unreadable ({type(e).__name__})"
    if not shards:
        return -3, f"{path} has no shard-*.safetensors file"
    world = meta.get("world_size")
    for r in range(world if isinstance(world, int) else 0):
        if not any(s.name.startswith(SHARD.format(r + 1)) for s in shards):
            return -2, (f"{path / SHARD.format(r + 1)}*.safetensors is missing: rank {r}'s shard of the {world} ranks "
                        f"meta.json says saved it")
        if meta.get("manifest") and not (path / "rng" / f"rank_{r}.safetensors").is_file():
            return -2, f"{path / 'rng' / f'rank_{r}.safetensors'} is missing: rank {r} of {world} saved it"
    problem = _tiling_problem(shards)
    return (-1, f"{path}: {problem}") if problem else None


def _tiling_problem(shards: list[Path]) -> str | None:
    """Each tensor's saved pieces (shape at offset, from every shard's header) must cover its whole
    shape: a missing rank's file leaves a hole, whatever meta.json says."""
    pieces: dict[str, list[tuple[list[int], list[int]]]] = {}
    for shard in shards:
        header = _header(shard)
        if header is None:
            continue  # safetensors_problem names it
        try:
            info = json.loads((header.get("__metadata__") or {}).get("DCP_SHARDING_INFO") or "{}")
            for key, entry in header.items():
                if key != "__metadata__":
                    offsets = info[key]["saved_offsets"] if key in info else [0] * len(entry["shape"])
                    pieces.setdefault(key, []).append((list(offsets), list(entry["shape"])))
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{shard} has a corrupt header (its sharding information)"
    for key, parts in sorted(pieces.items()):
        try:
            whole = [max(offsets[d] + shape[d] for offsets, shape in parts) for d in range(len(parts[0][1]))]
            held, total = sum(math.prod(shape) for _, shape in parts), math.prod(whole)
        except (IndexError, TypeError):
            return f"the pieces of {key} in the shards' headers disagree in rank (a corrupt header)"
        if held != total:
            return (f"the shards hold {held} of the {total} elements of {key}: a rank's shard-*.safetensors "
                    f"is missing")
    return None


def _header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > path.stat().st_size:
                return None
            header = json.loads(f.read(length))
        return header if isinstance(header, dict) else None
    except (OSError, ValueError, struct.error):
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
        ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"has a corrupt header ({type(e).__name__})"
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
