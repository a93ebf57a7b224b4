"""Tokenize source shards into a content-keyed cache, split among ranks or worker processes.

Each shard (see sources.py) becomes ``<cache_dir>/<key>.bin`` (+ ``.json``) and, when documents
are held out for evaluation, ``<key>-heldout.bin``. The key hashes the SHA-256 of the shard's
bytes (integrity.py), the tokenizer (its file's bytes), the text field and the held-out
fraction: change any of them and the shard is tokenized anew. Files are written under a
temporary name and renamed, the held-out file last; a shard is done when both sidecars exist,
so a killed writer leaves nothing that a reader would take for finished work. Each sidecar is
its file's manifest (size and checksum): a done shard whose file no longer matches is rebuilt,
with a line naming it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parallel3d.data.dataset import write_token_file
from parallel3d.data.integrity import token_file_problem
from parallel3d.data.sources import Shard, documents
from parallel3d.data.tokenizer import tokenizer_hash

FORMAT = 2  # bump when the token layout changes (BOS/EOS placement, held-out rule)


@dataclass(frozen=True)
class ShardFiles:
    train: Path
    heldout: Path | None  # None when nothing is held out

    def done(self) -> bool:
        return all(p.with_suffix(".json").is_file() for p in (self.train, self.heldout) if p is not None)


def shard_files(shard: Shard, tokenizer, text_field: str, heldout_fraction: float, cache_dir: str | Path) -> ShardFiles:
    root = Path(cache_dir).expanduser()
    identity = [FORMAT, shard.fingerprint(root / "digests"), tokenizer_hash(tokenizer.name), text_field,
                heldout_fraction]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
    stem = f"{shard.path.name[:40]}-{key}"
    return ShardFiles(root / f"{stem}.bin", root / f"{stem}-heldout.bin" if heldout_fraction > 0 else None)


_verified: set[tuple] = set()  # (file, inode, size, mtime, ctime of it and its manifest) checked here


def cache_problem(files: ShardFiles) -> str | None:
    """A done shard's file that no longer matches its manifest: ``FILE: what is wrong``, or None.
    A file is read once per process (the held-out corpus opens the same shards again)."""
    for path in (files.train, files.heldout):
        if path is None:
            continue
        try:
            seen = (str(path), *[(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                                 for st in (path.stat(), path.with_suffix(".json").stat())])
        except OSError:
            seen = None  # a file missing: token_file_problem says so
        if seen in _verified:
            continue
        problem = token_file_problem(path)
        if problem:
            return f"{path}: {problem}"
        _verified.add(seen)
    return None


def is_heldout(text: str, fraction: float) -> bool:
    """A stable choice per document: the same text is held out in every run, on every machine."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def tokenize_shard(shard: Shard, files: ShardFiles, tokenizer, text_field: str, heldout_fraction: float,
                   worker: str, progress: Callable[[int], None] | None = None) -> ShardFiles:
    """Write the shard's token files (training documents; held-out ones apart)."""
    heldout: list[str] = []

    def training_documents():
        for text in documents(shard, text_field):
            if is_heldout(text, heldout_fraction):
                heldout.append(text)
            else:
                yield text

    meta = {"shard": str(shard.path), "tokenized_by": worker}
    write_token_file(training_documents(), tokenizer, files.train, progress, extra_meta=meta)
    if files.heldout is not None:  # last: its sidecar completes the shard
        write_token_file(heldout, tokenizer, files.heldout, extra_meta=meta)
    return files


def prepare_shards(shards: list[Shard], tokenizer, text_field: str, heldout_fraction: float,
                   cache_dir: str | Path, rank: int = 0, world_size: int = 1,
                   barrier: Callable[[], None] | None = None) -> list[ShardFiles]:
    """Every shard's files, tokenizing the missing ones and rebuilding corrupt ones: rank r
    hashes, checks and tokenizes shards r, r + world, ...; then all ranks wait at ``barrier``
    for the others' shards (their digests are then remembered: nothing is hashed twice)."""
    own = range(rank, len(shards), world_size)
    for i in own:
        files = shard_files(shards[i], tokenizer, text_field, heldout_fraction, cache_dir)
        problem = cache_problem(files) if files.done() else None
        if problem:
            print(f"parallel3d: rebuilding cached tokens {problem}", file=sys.stderr, flush=True)
        if problem or not files.done():
            tokenize_shard(shards[i], files, tokenizer, text_field, heldout_fraction, f"rank {rank}")
    if barrier is not None:
        barrier()
    files = [shard_files(s, tokenizer, text_field, heldout_fraction, cache_dir) for s in shards]
    missing = [str(s.path) for s, f in zip(shards, files) if not f.done()]
    if missing:
        raise RuntimeError(f"shards not tokenized after every rank finished: {missing[:3]} "
                           "(is data.cache_dir shared by all nodes? it must be)")
    return files
