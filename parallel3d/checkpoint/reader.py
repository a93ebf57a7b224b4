"""A DCP storage reader that verifies what it reads: each byte comes from the disk once.

``checkpoint.verify=checksum`` used to hash every block of a checkpoint before the load read the
same bytes again. Here the load's own reads are checked: for each shard file a rank reads from,
the 64 MiB blocks holding the tensors it reads are hashed in threads, ahead of the copies, from a
memory map (which pulls them into the page cache), and a tensor is copied out only after every
block under it matched the manifest (``manifest.json``). A shard's first block, which holds its
header (parsed by DCP to plan the load, before any data is read), was verified with the rest of
the folder (resume.pick_checkpoint, ``hashed_at_load``) and is not hashed again. A mismatch raises ``ChecksumMismatch``
before any byte of that block reaches a tensor; DCP raises it on every rank, and the resume
falls back to the previous checkpoint (checkpoint/resume.py).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash
from torch.distributed.checkpoint import HuggingFaceStorageReader

from parallel3d.base import RunError
from parallel3d.checkpoint.errors import first_failure
from parallel3d.checkpoint.manifest import CHECKSUM


class ChecksumMismatch(RunError):
    """A block a load was about to copy from does not match the checkpoint's manifest."""


def mismatch_of(error: BaseException) -> str | None:
    """The ChecksumMismatch line behind a failed load (a CheckpointError from DCP's), or None."""
    cause = first_failure(error.__cause__ if error.__cause__ is not None else error)
    return str(cause) if isinstance(cause, ChecksumMismatch) else None


class VerifyingReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader that checks each block it reads against ``manifest`` (read_manifest's),
    and copies each tensor from the file's memory map into its target once."""

    def __init__(self, path: str, manifest: dict):
        super().__init__(path=path)
        self.manifest, self.folder = manifest, Path(path)

    def read_data(self, plan, planner) -> torch.futures.Future:
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        block = self.manifest["block_bytes"]
        with contextlib.ExitStack() as maps, ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 16)),
                                                                thread_name_prefix="checkpoint-verify") as pool:
            mapped = {name: maps.enter_context(_Mapped(name)) for name in per_file}
            hashed = {name: self._hash_ahead(pool, mapped[name], reqs, block) for name, reqs in per_file.items()}
            try:
                for name, reqs in per_file.items():
                    tensors, pending = hashed[name]
                    for req in sorted(reqs, key=lambda r: tensors[r.storage_index.fqn][2]):
                        self._check(Path(name), tensors[req.storage_index.fqn][2:], block, pending)
                        _copy(mapped[name].data, tensors[req.storage_index.fqn], req, planner)
            except BaseException:
                pool.shutdown(cancel_futures=True)  # a mismatch: the blocks not hashed yet are not needed
                raise
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _hash_ahead(self, pool: ThreadPoolExecutor, mapped: _Mapped, reqs: list, block: int) -> tuple[dict, dict]:
        """Each read tensor (dtype, shape, byte span) in the file, and the hashes of the blocks under
        them, started (from the same memory map the copies read: its pages are filled once)."""
        entries = _tensors(mapped.path)
        tensors = {r.storage_index.fqn: entries[r.storage_index.fqn] for r in reqs}
        blocks = sorted({b for entry in tensors.values() for b in _blocks_under(entry[2:], block) if b > 0})
        return tensors, {b: pool.submit(mapped.hash, b * block, (b + 1) * block) for b in blocks}

    def _check(self, path: Path, span: tuple[int, int], block: int, pending: dict) -> None:
        wanted = self.manifest["files"].get(path.relative_to(self.folder).as_posix(), {}).get(CHECKSUM, [])
        for b in _blocks_under(span, block):
            if b == 0:
                continue  # the header's block: verified before the load planned anything
            got = pending[b].result()
            if b >= len(wanted) or got != wanted[b]:
                end = min((b + 1) * block, path.stat().st_size)
                raise ChecksumMismatch(f"{path}: checksum mismatch in bytes {b * block}..{end} ({CHECKSUM} {got}, "
                                       f"manifest {wanted[b] if b < len(wanted) else None})")


MADV_POPULATE_READ = 22  # Linux >= 5.14: fill a range's page tables (reading a cold disk) in one call
_CHUNK = 8 << 20  # bytes per hash update: each releases the GIL


class _Mapped:
    """One shard file, memory-mapped once for its hashes (threads) and its copies (the load)."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.file = open(path, "rb")
        self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
        self.view = memoryview(self.map)
        with warnings.catch_warnings():  # read-only bytes, only ever copied from
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            self.data = torch.frombuffer(self.map, dtype=torch.uint8)

    def hash(self, start: int, end: int) -> str:
        """XXH3-64 (hex) of bytes [start, end) (to the file's end), as manifest.hash_of gives it."""
        end = min(end, len(self.map))
        if end > start:
            try:
                self.map.madvise(MADV_POPULATE_READ, start - start % mmap.PAGESIZE, end - start + start % mmap.PAGESIZE)
            except OSError:  # an older kernel: ask for read-ahead instead
                self.map.madvise(mmap.MADV_WILLNEED, start - start % mmap.PAGESIZE, end - start + start % mmap.PAGESIZE)
        digest = xxhash.xxh3_64()
        for at in range(start, end, _CHUNK):
            digest.update(self.view[at:min(at + _CHUNK, end)])
        return digest.hexdigest()

    def __enter__(self) -> _Mapped:
        return self

    def __exit__(self, *exc) -> None:
        del self.data  # no tensor may hold the map when it closes
        self.view.release()
        with contextlib.suppress(BufferError):  # a view kept alive by a traceback: closed when collected
            self.map.close()
        self.file.close()


def _blocks_under(span: tuple[int, int], block: int) -> range:
    """The blocks holding bytes [start, end) (none for an empty tensor: nothing is read)."""
    start, end = span
    return range(start // block, (end - 1) // block + 1) if end > start else range(0)


def _tensors(path: Path) -> dict[str, tuple]:
    """Each tensor's (dtype, shape, start, end) in a safetensors file: its bytes [start, end), past
    the header."""
    from safetensors.torch import _getdtype

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {key: (_getdtype(entry["dtype"]), entry["shape"], 8 + length + entry["data_offsets"][0],
                  8 + length + entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"}


def _copy(data: torch.Tensor, tensor: tuple, req, planner) -> None:
    """DCP's read request ``req`` served from the file's bytes ``data`` (a memory map): its slice of
    the stored tensor copied straight into the target, once (DCP's reader copies it out of the
    file into a new tensor first, then into the target)."""
    dtype, shape, start, end = tensor
    stored = data[start:end]
    if start % dtype.itemsize:  # not aligned for a view as its dtype: through an aligned copy
        stored = stored.clone()
    source = stored.view(dtype).view(shape)[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
    target = planner.resolve_tensor(req).detach()
    if target.size() != source.size():
        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {source.size()}")
    target.copy_(source)
    planner.commit_tensor(req, target)
