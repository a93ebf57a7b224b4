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

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader

from parallel3d.checkpoint.errors import ChecksumMismatch
from parallel3d.checkpoint.manifest import CHECKSUM, hash_of


class VerifyingReader(HuggingFaceStorageReader):
    """HuggingFaceStorageReader that checks each block it reads against ``manifest`` (read_manifest's)."""

    def __init__(self, path: str, manifest: dict):
        super().__init__(path=path)
        self.manifest, self.folder = manifest, Path(path)

    def read_data(self, plan, planner) -> torch.futures.Future:
        from safetensors import safe_open

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        block = self.manifest["block_bytes"]
        with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 16)), thread_name_prefix="checkpoint-verify") as pool:
            hashed = {name: self._hash_ahead(pool, Path(name), reqs, block) for name, reqs in per_file.items()}
            try:
                for name, reqs in per_file.items():
                    spans, pending = hashed[name]
                    with safe_open(filename=name, framework="pt") as f:
                        for req in sorted(reqs, key=lambda r: spans[r.storage_index.fqn][0]):
                            self._check(Path(name), spans[req.storage_index.fqn], block, pending)
                            self._process_read_request(f, req, planner)
            except BaseException:
                pool.shutdown(cancel_futures=True)  # a mismatch: the blocks not hashed yet are not needed
                raise
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done

    def _hash_ahead(self, pool: ThreadPoolExecutor, path: Path, reqs: list, block: int) -> tuple[dict, dict]:
        """Each read tensor's byte span in ``path``, and the hashes of the blocks under them, started."""
        offsets = _data_offsets(path)
        spans = {r.storage_index.fqn: offsets[r.storage_index.fqn] for r in reqs}
        blocks = sorted({b for span in spans.values() for b in _blocks_under(span, block) if b > 0})
        return spans, {b: pool.submit(hash_of, path, b * block, block) for b in blocks}

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


def _blocks_under(span: tuple[int, int], block: int) -> range:
    """The blocks holding bytes [start, end) (none for an empty tensor: nothing is read)."""
    start, end = span
    return range(start // block, (end - 1) // block + 1) if end > start else range(0)


def _data_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) bytes in a safetensors file (the header's offsets, past the header)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {key: (8 + length + entry["data_offsets"][0], 8 + length + entry["data_offsets"][1])
            for key, entry in header.items() if key != "__metadata__"}
