"""Tokenize source shards into a content-keyed cache, split among ranks or worker processes.

Each shard (see sources.py) becomes ``<cache_dir>/<key>.bin`` (+ ``.json``) and, when documents
are held out for evaluation, ``<key>-heldout.bin``. The key hashes the shard's file names, sizes
and modification times, the tokenizer (its file's bytes), the text field and the held-out
fraction: change any of them and the shard is tokenized anew. Files are written under a
temporary name and renamed, the held-out file last; a shard is done when both sidecars exist,
so a killed writer leaves nothing that a reader would take for finished work.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from parallel3d.data.dataset import write_token_file
from parallel3d.data.sources import Shard, documents

FORMAT = 1  # bump when the token layout changes (BOS/EOS placement, held-out rule)


@dataclass(frozen=True)
class ShardFiles:
    train: Path
    heldout: Path | None  # None when nothing is held out

    def done(self) -> bool:
        return all(p.with_suffix(".json").is_file() for p in (self.train, self.heldout) if p is not None)


def tokenizer_fingerprint(tokenizer) -> str:
    if tokenizer.name == "byte":
        return "byte"
    return hashlib.sha256(Path(tokenizer.name).expanduser().read_bytes()).hexdigest()[:16]


def shard_files(shard: Shard, tokenizer, text_field: str, heldout_fraction: float, cache_dir: str | Path) -> ShardFiles:
    identity = [FORMAT, shard.fingerprint(), tokenizer_fingerprint(tokenizer), text_field, heldout_fraction]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
    root = Path(cache_dir).expanduser()
    stem = f"{shard.path.name[:40]}-{key}"
    return ShardFiles(root / f"{stem}.bin", root / f"{stem}-heldout.bin" if heldout_fraction > 0 else None)


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
    """Every shard's files, tokenizing the missing ones: rank r takes shards r, r + world, ...;
    then all ranks wait at ``barrier`` for the others' shards."""
    files = [shard_files(s, tokenizer, text_field, heldout_fraction, cache_dir) for s in shards]
    for i in range(rank, len(shards), world_size):
        if not files[i].done():
            tokenize_shard(shards[i], files[i], tokenizer, text_field, heldout_fraction, f"rank {rank}")
    if barrier is not None:
        barrier()
    missing = [str(s.path) for s, f in zip(shards, files) if not f.done()]
    if missing:
        raise RuntimeError(f"shards not tokenized after every rank finished: {missing[:3]} "
                           "(is data.cache_dir shared by all nodes? it must be)")
    return files
