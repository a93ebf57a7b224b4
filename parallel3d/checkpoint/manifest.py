"""A folder's manifest: each file's size and checksum, written when the folder is complete and
checked before anything in it is used.

``manifest.json`` maps each file (its path relative to the folder) to its size in bytes and the
XXH3-64 hash of each 64 MiB block of it. XXH3 (the ``xxhash`` package, which ``datasets`` already
requires) detects truncation, flipped bits and overwritten blocks at ~3x the speed of zlib's CRC-32
and far above any cryptographic hash here (BENCHMARKS.md): it guards against accidents, not
against an attacker who can rewrite the manifest too. Blocks are hashed in parallel threads
(xxhash releases the GIL), so one large file (a single rank's shard) does not hash on one core.

    write_manifest(folder, files)                 # after the files, before the folder's marker
    verify_manifest(folder, "checksum")           # None, or one line: which file, what is wrong

Many ranks share the reading: each hashes the files it wrote (``file_entries``) and one writes
the manifest from all entries (``write_manifest(..., entries=...)``); ``verify_manifest(...,
group=...)`` has each rank of a process group check every n-th file and block, and one
all-gather gives every rank the answer a single process would give.

Verify modes: ``checksum`` (sizes and hashes), ``size`` (sizes only: a stat per file), ``none``.
"""

from __future__ import annotations

import fnmatch
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Iterable

import torch.distributed as dist
import xxhash

MANIFEST = "manifest.json"
VERIFY_MODES = ("checksum", "size", "none")
_CHUNK = 8 << 20  # bytes per hash update: each releases the GIL
BLOCK = 64 << 20  # bytes per hash: the unit of parallel hashing
CHECKSUM = "xxh3_64"
_FORMAT = 1


class ManifestMissing(FileNotFoundError):
    """The folder was written without a manifest (by an older version, say): nothing to check against."""


def hash_of(path: Path, start: int = 0, length: int | None = None) -> str:
    """XXH3-64 (hex) of ``length`` bytes of a file from ``start`` (to its end by default). Read through a
    memory map: the page cache's own pages, no copy into a buffer first. (A file cut short while
    mapped would fault: a folder is hashed when nothing writes it, after its save, before its use.)"""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        end = size if length is None else min(size, start + length)
        digest = xxhash.xxh3_64()
        if end > start:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for at in range(start, end, _CHUNK):
                        digest.update(view[at:min(at + _CHUNK, end)])
                finally:
                    view.release()
    return digest.hexdigest()


def _hash_blocks(folder: Path, blocks: list[tuple[str, int]], block: int) -> list[str]:
    """The hash of each (file, start) block of ``block`` bytes, in parallel threads."""
    with ThreadPoolExecutor(max(1, min(len(blocks), os.cpu_count() or 1, 16))) as pool:
        return list(pool.map(lambda b: hash_of(folder / b[0], b[1], block), blocks))


def _blocks(sizes: dict[str, int], block: int) -> list[tuple[str, int]]:
    return [(name, start) for name, size in sizes.items() for start in range(0, max(size, 1), block)]


def block_hashes(folder: Path, sizes: dict[str, int], block: int) -> dict[str, list[str]]:
    """Each file's hash per ``block`` bytes, the blocks of all files hashed in parallel threads."""
    blocks = _blocks(sizes, block)
    found: dict[str, list[str]] = {name: [] for name in sizes}
    for (name, _), digest in zip(blocks, _hash_blocks(folder, blocks, block)):
        found[name].append(digest)
    return found


def _names(folder: Path, files: Iterable[str | Path]) -> list[str]:
    return sorted({Path(f).relative_to(folder).as_posix() if Path(f).is_absolute() else Path(f).as_posix()
                   for f in files})


def file_entries(folder: Path, files: Iterable[str | Path]) -> dict[str, dict]:
    """The manifest entries (size, block hashes) of ``files`` under ``folder``: what one rank
    contributes for the files it wrote itself, hashed where they were written."""
    folder = Path(folder)
    sizes = {name: (folder / name).stat().st_size for name in _names(folder, files)}
    hashes = block_hashes(folder, sizes, BLOCK)
    return {name: {"size": sizes[name], CHECKSUM: hashes[name]} for name in sizes}


def write_manifest(folder: Path, files: Iterable[str | Path], *, entries: dict[str, dict] | None = None) -> dict:
    """Hash ``files`` (paths under ``folder``, relative or not) and write ``folder/manifest.json``
    atomically (a temporary name, fsync, rename). ``entries``: files hashed already (file_entries,
    by the ranks that wrote them), taken as they are. Returns the manifest."""
    folder, entries = Path(folder), entries or {}
    listed = entries | file_entries(folder, [name for name in _names(folder, files) if name not in entries])
    manifest = {"format": _FORMAT, "checksum": CHECKSUM, "block_bytes": BLOCK,
                "files": {name: listed[name] for name in sorted(listed)}}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return manifest


def read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``; ManifestMissing when there is none, ValueError when it is corrupt
    or hostile: only what this version writes is taken (its format, checksum and block size, every
    entry a size and its blocks' hashes, every name a file inside ``folder``), so verifying it
    costs what the files cost and never reads outside the folder."""
    path = Path(folder) / MANIFEST
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, more than any manifest this version writes")
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestMissing(f"{path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 ({e.reason})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path} has no files table")
    for key, wanted in (("format", _FORMAT), ("checksum", CHECKSUM), ("block_bytes", BLOCK)):
        if manifest.get(key) != wanted or type(manifest.get(key)) is not type(wanted):
            raise ValueError(f"{key} {manifest.get(key)!r}: this version writes {wanted!r}")
    inside = Path(folder).resolve()
    for name, entry in manifest["files"].items():
        _check_entry(inside, name, entry)
    return manifest


MAX_MANIFEST_BYTES = 64 << 20  # a real one lists a few hundred bytes a file


def _check_entry(inside: Path, name: str, entry) -> None:
    """One file's entry: a relative name that stays inside the folder, a size, a hash per block."""
    parts = PurePosixPath(name).parts
    if not name or "\\" in name or PurePosixPath(name).is_absolute() or any(p in ("..", ".") for p in parts) \
            or not (inside / name).resolve().is_relative_to(inside):
        raise ValueError(f"entry {name!r} names a file outside the folder")
    if not isinstance(entry, dict) or type(entry.get("size")) is not int or entry["size"] < 0:
        raise ValueError(f"entry {name!r} has no size")
    hashes = entry.get(CHECKSUM)
    if not isinstance(hashes, list) or len(hashes) != max(1, -(-entry["size"] // BLOCK)) \
            or not all(isinstance(h, str) for h in hashes):
        raise ValueError(f"entry {name!r} does not have one {CHECKSUM} hash per {BLOCK}-byte block")


def file_problem(folder: Path, name: str, mode: str) -> str | None:
    """What is wrong with one file of ``folder`` against its manifest (``mode``: ``size`` or
    ``checksum``), as one line, or None; ManifestMissing when there is none. For a small file read
    before the whole folder is verified (a checkpoint's config.yaml, at validation)."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except ValueError as e:
        return f"{folder / MANIFEST} is unreadable ({' '.join(str(e).split())})"
    entry = manifest["files"].get(name)
    if entry is None:
        return f"{folder / name} is not in the manifest"
    if mode == "none" or (problem := _size_problem(folder / name, entry["size"])):
        return None if mode == "none" else problem
    if mode == "checksum":
        found = _checksum_problem(folder, manifest, _blocks({name: entry["size"]}, manifest["block_bytes"]))
        return found[-1] if found else None
    return None


def gathered(value, group) -> list:
    """``value`` of every rank of ``group`` in rank order, on every rank (``[value]`` without a group)."""
    if group is None:
        return [value]
    values = [None] * group.size()
    dist.all_gather_object(values, value, group=group)
    return values


def verify_manifest(folder: Path, mode: str, *, ignore: Iterable[str] = (), group=None) -> str | None:
    """What is wrong with ``folder`` against its manifest, as one line naming the file, or None.

    Every listed file must exist with its size (and, under ``checksum``, its hash); every other
    file in the folder must be listed, except the manifest and names matching an ``ignore`` pattern
    (a marker written after the manifest, say). Raises ManifestMissing when there is no manifest.
    ``group``: a process group whose ranks split the work (each checks every n-th file and block)
    and then agree, in one all-gather, on the same answer a single process would give.
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r}: expected one of {VERIFY_MODES}")
    if mode == "none":
        return None
    share = (group.rank(), group.size()) if group is not None else (0, 1)
    return first_problem(Path(folder), gathered(share_problem(folder, mode, ignore=ignore, share=share), group))


def first_problem(folder: Path, problems: list[tuple | None]) -> str | None:
    """The one line of the ranks' share_problem results: the one a single process finds first."""
    if NO_MANIFEST in problems:
        raise ManifestMissing(f"{folder / MANIFEST} does not exist")
    found = [p for p in problems if p is not None]
    return min(found)[-1] if found else None


def share_problem(folder: Path, mode: str, *, ignore: Iterable[str] = (), share: tuple[int, int] = (0, 1),
                  hashed_later: str | None = None):
    """This rank's part of verify_manifest: ``share`` = (index, count) checks every count-th file
    (from the index-th) and every count-th block. The first problem as a sortable (kind, file,
    offset, line), NO_MANIFEST, or None. ``hashed_later``: a pattern of files of which only the
    first block is hashed here (it holds a safetensors header, which a load parses before reading
    data); the load hashes the others as it reads them (checkpoint/reader.py)."""
    folder, (index, count) = Path(folder), share
    try:
        manifest = read_manifest(folder)
        listed, block = manifest["files"], manifest["block_bytes"]
    except ManifestMissing:
        return NO_MANIFEST
    except (ValueError, OSError) as e:
        return 0, "", 0, f"{folder / MANIFEST} is unreadable ({' '.join(str(e).split())})"
    blocks = _blocks({name: listed[name]["size"] for name in sorted(listed)}, block)[index::count]
    try:
        for name in sorted(set(sorted(listed)[index::count]) | {name for name, _ in blocks}):
            if problem := _size_problem(folder / name, listed[name]["size"]):
                return 1, name, 0, problem
        if index == 0 and (problem := _unlisted(folder, listed, (MANIFEST, MANIFEST + ".tmp", *ignore))):
            return problem
        if mode == "checksum":
            now = [b for b in blocks if not hashed_later or b[1] == 0 or not fnmatch.fnmatch(b[0], hashed_later)]
            return _checksum_problem(folder, manifest, now)
    except OSError as e:  # unreadable (an I/O error): a problem like any other, on every rank
        return 1, Path(e.filename or "").name, 0, f"{e.filename or folder} is unreadable ({e.strerror or e})"
    return None


NO_MANIFEST = (-1, "", 0, "")


def _size_problem(path: Path, expected: int) -> str | None:
    if not path.is_file():
        return f"{path} is missing"
    if (size := path.stat().st_size) != expected:
        how = "truncated" if size < expected else "overwritten or appended to"
        return f"{path}: size {size} != {expected} in the manifest ({how})"
    return None


def _unlisted(folder: Path, listed: dict, patterns: tuple[str, ...]) -> tuple | None:
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name not in listed and not any(fnmatch.fnmatch(name, p) for p in patterns):
            return 2, name, 0, f"{path} is not in the manifest"
    return None


def _checksum_problem(folder: Path, manifest: dict, blocks: list[tuple[str, int]]) -> tuple | None:
    listed, block = manifest["files"], manifest["block_bytes"]
    for (name, start), got in zip(blocks, _hash_blocks(folder, blocks, block)):
        wanted = listed[name][CHECKSUM]
        want = wanted[start // block] if start // block < len(wanted) else None
        if got != want:
            end = min(start + block, listed[name]["size"])
            return 4, name, start, (f"{folder / name}: checksum mismatch in bytes {start}..{end} "
                                    f"({CHECKSUM} {got}, manifest {want})")
    return None
