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

Verify modes: ``checksum`` (sizes and hashes), ``size`` (sizes only: a stat per file), ``none``.
"""

from __future__ import annotations

import fnmatch
import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

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


def block_hashes(folder: Path, sizes: dict[str, int], block: int) -> dict[str, list[str]]:
    """Each file's hash per ``block`` bytes, the blocks of all files hashed in parallel threads."""
    blocks = [(name, start) for name, size in sizes.items() for start in range(0, max(size, 1), block)]
    with ThreadPoolExecutor(max(1, min(len(blocks), os.cpu_count() or 1, 16))) as pool:
        hashes = pool.map(lambda b: hash_of(folder / b[0], b[1], block), blocks)
        found: dict[str, list[str]] = {name: [] for name in sizes}
        for (name, _), digest in zip(blocks, hashes):
            found[name].append(digest)
    return found


def write_manifest(folder: Path, files: Iterable[str | Path]) -> dict:
    """Hash ``files`` (paths under ``folder``, relative or not) and write ``folder/manifest.json``
    atomically (a temporary name, fsync, rename). Returns the manifest."""
    folder = Path(folder)
    names = sorted({Path(f).relative_to(folder).as_posix() if Path(f).is_absolute() else Path(f).as_posix()
                    for f in files})
    sizes = {name: (folder / name).stat().st_size for name in names}
    hashes = block_hashes(folder, sizes, BLOCK)
    manifest = {"format": _FORMAT, "checksum": CHECKSUM, "block_bytes": BLOCK,
                "files": {name: {"size": sizes[name], CHECKSUM: hashes[name]} for name in names}}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)
    return manifest


def read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``; ManifestMissing when there is none, ValueError when it is corrupt."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestMissing(f"{path} does not exist") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{path} has no files table")
    return manifest


def verify_manifest(folder: Path, mode: str, *, ignore: Iterable[str] = ()) -> str | None:
    """What is wrong with ``folder`` against its manifest, as one line naming the file, or None.

    Every listed file must exist with its size (and, under ``checksum``, its hash); every other
    file in the folder must be listed, except the manifest and names matching an ``ignore`` pattern
    (a marker written after the manifest, say). Raises ManifestMissing when there is no manifest.
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r}: expected one of {VERIFY_MODES}")
    if mode == "none":
        return None
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
        listed, block = manifest["files"], manifest.get("block_bytes", BLOCK)
    except (ValueError, OSError) as e:
        if isinstance(e, ManifestMissing):
            raise
        return f"{folder / MANIFEST} is unreadable ({' '.join(str(e).split())})"
    for name, entry in sorted(listed.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if (size := path.stat().st_size) != entry["size"]:
            how = "truncated" if size < entry["size"] else "overwritten or appended to"
            return f"{path}: size {size} != {entry['size']} in the manifest ({how})"
    patterns = (MANIFEST, MANIFEST + ".tmp", *ignore)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name not in listed and not any(fnmatch.fnmatch(name, p) for p in patterns):
            return f"{path} is not in the manifest"
    if mode == "checksum":
        if manifest.get("checksum") != CHECKSUM:
            return f"{folder / MANIFEST}: unknown checksum {manifest.get('checksum')!r} (expected {CHECKSUM})"
        found = block_hashes(folder, {name: entry["size"] for name, entry in listed.items()}, block)
        for name in sorted(listed):
            for i, (got, want) in enumerate(zip(found[name], listed[name][CHECKSUM])):
                if got != want:
                    start = i * block
                    end = min(start + block, listed[name]["size"])
                    return (f"{folder / name}: checksum mismatch in bytes {start}..{end} "
                            f"({CHECKSUM} {got}, manifest {want})")
    return None
