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

import numpy as np

from parallel3d.data.dataset import token_dtype, write_array_file, write_token_file
from parallel3d.data.integrity import token_file_problem
from parallel3d.data.sft import RowStats, SFTSpec, build_rows, records, render_sample
from parallel3d.data.sources import DataError, Shard, documents
from parallel3d.data.tokenizer import tokenizer_hash
from parallel3d.progress import Progress

FORMAT = 3  # bump when the token layout changes (BOS/EOS placement, held-out rule, row flags)


@dataclass(frozen=True)
class ShardFiles:
    train: Path
    heldout: Path | None  # None when nothing is held out
    rows: bool = False  # instruction data: rows of seq_len + 1 tokens, each with a flags file beside it

    def done(self) -> bool:
        return all(p.with_suffix(".json").is_file() for p in (self.train, self.heldout) if p is not None)

    def all_files(self) -> list[Path]:
        """Every file of the shard, flags first (a token file's manifest is written last)."""
        tokens = [p for p in (self.train, self.heldout) if p is not None]
        return [f for p in tokens for f in ([flags_file(p), p] if self.rows else [p])]


def flags_file(tokens: Path) -> Path:
    """The per-token flags (parallel3d/data/sft.py) of a rows file."""
    return tokens.with_name(tokens.stem + ".flags.bin")


def shard_files(shard: Shard, tokenizer, text_field: str, heldout_fraction: float, cache_dir: str | Path,
                sft: SFTSpec | None = None) -> ShardFiles:
    root = Path(cache_dir).expanduser()
    identity = [FORMAT, shard.fingerprint(root / "digests"), tokenizer_hash(tokenizer.name), text_field,
                heldout_fraction]
    if sft is not None:  # how records become rows
        identity.append(sft.identity())
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:20]
    stem = f"{shard.path.name[:40]}-{key}"
    return ShardFiles(root / f"{stem}.bin", root / f"{stem}-heldout.bin" if heldout_fraction > 0 else None,
                      rows=sft is not None)


_verified: set[tuple] = set()  # (file, inode, size, mtime, ctime of it and its manifest) checked here


def cache_problem(files: ShardFiles) -> str | None:
    """A done shard's file that no longer matches its manifest: ``FILE: what is wrong``, or None.
    A file is read once per process (the held-out corpus opens the same shards again)."""
    for path in files.all_files():
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
                   worker: str, progress: Callable[[int], None] | None = None, sft: SFTSpec | None = None
                   ) -> ShardFiles:
    """Write the shard's token files (training documents; held-out ones apart)."""
    if sft is not None:
        return _write_rows(shard, files, tokenizer, heldout_fraction, worker, sft, progress)
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


def _write_rows(shard: Shard, files: ShardFiles, tokenizer, heldout_fraction: float, worker: str,
                sft: SFTSpec, progress: Callable[[int], None] | None = None) -> ShardFiles:
    """Instruction records rendered and laid out in rows (parallel3d/data/sft.py): each rows file
    with its flags file, the held-out records' apart; the counts go into the manifests.
    ``progress(records read so far)``."""
    heldout: list[tuple[int, dict]] = []

    def training_records():
        count = 0
        for count, record in enumerate(records(shard, sft.fields), start=1):
            if progress is not None and count % 1000 == 0:
                progress(count)
            if is_heldout(json.dumps(record, sort_keys=True), heldout_fraction):
                heldout.append((count - 1, record))
            else:
                yield count - 1, record
        if progress is not None:
            progress(count)

    for chosen, path in ((training_records(), files.train), (heldout, files.heldout)):
        if path is None:
            continue
        stats = RowStats()
        samples = (rendered(shard, index, record, sft, tokenizer) for index, record in chosen)
        rows = list(build_rows(samples, sft, tokenizer.eos_id, stats))
        meta = {"shard": str(shard.path), "tokenized_by": worker, "tokenizer": tokenizer.name,
                "vocab_size": tokenizer.vocab_size, "rows_of": sft.seq_len + 1, "packing": sft.packing,
                **stats.as_meta()}
        write_array_file((f for _, f in rows), np.uint8, flags_file(path), meta)
        write_array_file((t for t, _ in rows), token_dtype(tokenizer), path, meta)  # its manifest: done
    return files


def rendered(shard: Shard, index: int, record: dict, sft: SFTSpec, tokenizer) -> tuple[list[int], list[bool]]:
    """``render_sample`` of record ``index`` (0-based, in file order) of ``shard``; a chat template
    that fails on it (its raise_exception, a turn it cannot place) is a DataError naming the record."""
    try:
        return render_sample(record, sft, tokenizer)
    except Exception as e:  # jinja2's errors, or the ValueError of a template whose turns cannot be located
        template = sft.template.origin if sft.template is not None else "the chat template"
        problem = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise DataError(f"{shard.path} record {index}", f"the chat template {template} fails on it ({problem})",
                        "fix that record (or the template: data.chat_template=FILE)") from None


def prepare_shards(shards: list[Shard], tokenizer, text_field: str, heldout_fraction: float,
                   cache_dir: str | Path, rank: int = 0, world_size: int = 1,
                   barrier: Callable[[], None] | None = None, sft: SFTSpec | None = None) -> list[ShardFiles]:
    """Every shard's files, tokenizing the missing ones and rebuilding corrupt ones: rank r
    hashes, checks and tokenizes shards r, r + world, ...; then all ranks wait at ``barrier``
    for the others' shards (their digests are then remembered: nothing is hashed twice)."""
    own = range(rank, len(shards), world_size)
    if rank == 0:  # first use can take minutes: say what is going on
        missing = sum(not shard_files(s, tokenizer, text_field, heldout_fraction, cache_dir, sft).done() for s in shards)
        if missing:
            print(f"parallel3d: tokenizing {missing} of {len(shards)} shards into {cache_dir} (first use"
                  f"{f'; {world_size} ranks share them' if world_size > 1 else ''})", flush=True)
    for i in own:
        files = shard_files(shards[i], tokenizer, text_field, heldout_fraction, cache_dir, sft)
        problem = cache_problem(files) if files.done() else None
        if problem:
            print(f"parallel3d: rebuilding cached tokens {problem}", file=sys.stderr, flush=True)
        if problem or not files.done():
            unit, who = ("record" if sft else "tok"), (f" on rank {rank}" if world_size > 1 else "")
            with Progress(enabled=True).counter("tokenizing", unit, done=f"tokenized {shards[i].path}{who}") as update:
                tokenize_shard(shards[i], files, tokenizer, text_field, heldout_fraction, f"rank {rank}",
                               progress=update, sft=sft)
    if barrier is not None:
        barrier()
    files = [shard_files(s, tokenizer, text_field, heldout_fraction, cache_dir, sft) for s in shards]
    missing = [str(s.path) for s, f in zip(shards, files) if not f.done()]
    if missing:
        raise RuntimeError(f"shards not tokenized after every rank finished: {missing[:3]} "
                           "(is data.cache_dir shared by all nodes? it must be)")
    return files
