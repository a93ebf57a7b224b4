"""Content digests: what keys the tokenization cache and what proves a cache file whole.

A source file's key is the SHA-256 of its bytes, so an edit that keeps the size and the
modification time (``cp -p``, ``rsync -t``, ``tar x``) still changes it. Hashing is a streaming
pass; its result is remembered in ``<cache_dir>/digests/`` under the file's inode, size,
modification time and change time (ctime, which no copy tool can set back), so an unchanged
file is hashed once, not at every start. A token file's sidecar ``.json`` is its manifest: the
size and SHA-256 of the ``.bin``, written after it (see dataset.write_token_file).
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

DIGEST = "sha256"  # hashlib's; SHA-NI makes it as fast as crc32 on current CPUs (docs/data.md)


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes, read in a streaming pass."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, DIGEST).hexdigest()


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]  # not st_dev: it differs between NFS clients


def remembered_digest(path: Path, memo_dir: Path) -> str:
    """``file_digest(path)``, read from ``memo_dir`` when the file has not changed since it was
    computed (same inode, size, mtime and ctime); computed and remembered otherwise."""
    path = path.resolve()
    memo = memo_dir / f"{hashlib.sha256(str(path).encode()).hexdigest()[:24]}.json"
    key = _stat_key(path)
    try:
        saved = json.loads(memo.read_text())
        if saved["path"] == str(path) and saved["stat"] == key:
            return saved["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not remembered yet, or unreadable: compute it
    digest = file_digest(path)
    if _stat_key(path) == key:  # not written to while it was read
        try:
            write_atomic(memo, json.dumps({"path": str(path), "stat": key, "digest": digest}))
        except OSError:
            pass  # a read-only cache, a race with another node: only the next start hashes again
    return digest


def write_atomic(path: Path, text: str) -> None:
    """Write under a temporary name, then rename: a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # unique across nodes sharing the folder
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def token_file_problem(path: Path) -> str | None:
    """What is wrong with token file ``path`` against its sidecar manifest, or None when its size
    and checksum match. A sidecar without a checksum (written before they were kept) counts as
    unverifiable."""
    meta_path = path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
        expected_size = meta["num_tokens"] * _itemsize(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest {meta_path.name} is unreadable ({type(e).__name__})"
    if DIGEST not in meta:
        return f"its manifest {meta_path.name} has no checksum"
    if not path.is_file():
        return f"it is missing (its manifest {meta_path.name} is there)"
    size = path.stat().st_size
    if size != expected_size:
        return f"it is {size} bytes, its manifest says {expected_size}"
    if file_digest(path) != meta[DIGEST]:
        return f"its {DIGEST} differs from its manifest's (the bytes changed after it was written)"
    return None


def _itemsize(dtype: str) -> int:
    import numpy as np

    return np.dtype(dtype).itemsize


def prepared_file_problem(path: Path, memo_dir: Path) -> str | None:
    """``token_file_problem`` for a token file given as it is (not rebuildable from a source), with
    its digest remembered like a source's: read once, and again only after it changed."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return token_file_problem(path)
    if DIGEST not in meta or not path.is_file():  # written before checksums were kept: size only
        return None if DIGEST not in meta else token_file_problem(path)
    if remembered_digest(path, memo_dir) != meta[DIGEST]:
        return f"its {DIGEST} differs from its manifest's (the bytes changed after it was written)"
    return None
