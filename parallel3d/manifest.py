"""A folder's manifest: each file's size and checksum, written when the folder is complete and
checked before anything in it is used.

``manifest.json`` maps each file (its path relative to the folder) to its size in bytes and its
CRC-32. CRC-32 (zlib) detects truncation, flipped bits and overwritten blocks, and reads faster
than any cryptographic hash here (BENCHMARKS.md): it guards against accidents, not against an
attacker who can rewrite the manifest too. Files are hashed in parallel threads (zlib releases
the GIL on large buffers).

    write_manifest(folder, files)                 # after the files, before the folder's marker
    verify_manifest(folder, "checksum")           # None, or one line: which file, what is wrong

Verify modes: ``checksum`` (sizes and CRC-32s), ``size`` (sizes only: a stat per file), ``none``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

MANIFEST = "manifest.json"
VERIFY_MODES = ("checksum", "size", "none")
_CHUNK = 8 << 20
_FORMAT = 1


class ManifestMissing(FileNotFoundError):
    """The folder was written without a manifest (by an older version, say): nothing to check against."""


def crc32_of(path: Path) -> int:
    """CRC-32 of a file's bytes, read in chunks (constant memory)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _threads(count: int) -> int:
    return max(1, min(count, os.cpu_count() or 1, 16))


def write_manifest(folder: Path, files: Iterable[str | Path]) -> dict:
    """Hash ``files`` (paths under ``folder``, relative or not) and write ``folder/manifest.json``
    atomically (a temporary name, fsync, rename). Returns the manifest."""
    folder = Path(folder)
    names = sorted({Path(f).relative_to(folder).as_posix() if Path(f).is_absolute() else Path(f).as_posix()
                    for f in files})
    with ThreadPoolExecutor(_threads(len(names))) as pool:
        crcs = list(pool.map(lambda name: crc32_of(folder / name), names))
    manifest = {"format": _FORMAT, "checksum": "crc32",
                "files": {name: {"size": (folder / name).stat().st_size, "crc32": f"{crc:08x}"}
                          for name, crc in zip(names, crcs)}}
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

    Every listed file must exist with its size (and, under ``checksum``, its CRC-32); every other
    file in the folder must be listed, except the manifest and names matching an ``ignore`` pattern
    (a marker written after the manifest, say). Raises ManifestMissing when there is no manifest.
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r}: expected one of {VERIFY_MODES}")
    if mode == "none":
        return None
    folder = Path(folder)
    try:
        listed = read_manifest(folder)["files"]
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
        names = sorted(listed)
        with ThreadPoolExecutor(_threads(len(names))) as pool:
            crcs = list(pool.map(lambda name: crc32_of(folder / name), names))
        for name, crc in zip(names, crcs):
            if f"{crc:08x}" != listed[name]["crc32"]:
                return f"{folder / name}: checksum mismatch (crc32 {crc:08x}, manifest {listed[name]['crc32']})"
    return None
