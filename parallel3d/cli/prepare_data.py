#!/usr/bin/env python
"""Tokenize data sources ahead of training, in parallel worker processes; resumable.

    parallel3d-prepare-data --source DATA [--source MORE ...] --cache-dir DIR [--workers N]
                            [--tokenizer byte|path/to/tokenizer.json] [--text-field text]
                            [--eval-fraction F]

Each source is what ``data.sources`` accepts (.jsonl/.jsonl.gz/.json, .parquet, folders or globs
of them, datasets.save_to_disk folders, text folders). Every shard is tokenized into DIR under
its content key, exactly as training would do on first use, so a run with the same sources,
tokenizer, text field and eval.fraction finds them done:

    python -m parallel3d.train data.sources=[DATA,MORE] data.cache_dir=DIR [eval.fraction=F]

Killed, it resumes: finished shards are kept, unfinished ones (never visible as finished) are
redone. The one-file form of earlier versions still works:

    parallel3d-prepare-data --input DIR --output corpus.bin [--pattern "**/*.txt"]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import sys
import time
from pathlib import Path

from parallel3d.data import TokenFile, load_tokenizer, text_files, write_token_file
from parallel3d.data.shards import shard_files, tokenize_shard
from parallel3d.data.sources import resolve
from parallel3d.progress import Progress
from parallel3d.base import ConfigError

TMP_FILE = re.compile(r"^\..+\.(\d+)(\.json)?\.tmp$")  # write_token_file's temporary names carry the pid


def _tokenize(task):
    shard, files, tokenizer_spec, text_field, fraction = task
    start = time.perf_counter()
    tokenize_shard(shard, files, load_tokenizer(tokenizer_spec), text_field, fraction, f"worker {os.getpid()}")
    return shard, files, len(TokenFile(files.train)), time.perf_counter() - start


def _remove_abandoned(cache_dir: Path) -> None:
    """Temporary files of writers that no longer run on this machine (a killed earlier attempt)."""
    for path in cache_dir.glob(".*.tmp"):
        match = TMP_FILE.match(path.name)
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped by its new parent) writes no more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: the state letter follows the parenthesized command name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return not Path("/proc/self/stat").exists()  # gone since the kill above, or no /proc here
    except (OSError, IndexError):
        return True


def prepare(sources: list[str], cache_dir: Path, workers: int, tokenizer_spec: str, text_field: str,
            fraction: float) -> int:
    tokenizer = load_tokenizer(tokenizer_spec)
    shards = [s for source in sources for s in resolve(source)]
    files = [shard_files(s, tokenizer, text_field, fraction, cache_dir) for s in shards]
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(cache_dir)
    todo = [(s, f, tokenizer_spec, text_field, fraction) for s, f in zip(shards, files) if not f.done()]
    print(f"{len(shards) - len(todo)} of {len(shards)} shards already done; tokenizing {len(todo)} "
          f"with {workers} worker{'s' * (workers > 1)} into {cache_dir}", flush=True)
    start, total = time.perf_counter(), 0
    with Progress(enabled=True).counter("tokenizing", "shard") as update:
        # fork: the workers inherit the imports; each encodes on one core (no tokenizer threads).
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for done, (shard, shard_out, tokens, seconds) in enumerate(pool.imap_unordered(_tokenize, todo), 1):
                total += tokens
                update(done)
                print(f"tokenized {shard.path} -> {shard_out.train.name}: {tokens:,} tokens in {seconds:.1f}s "
                      f"[{done}/{len(todo)}]", flush=True)
    elapsed = time.perf_counter() - start
    print(f"done: {len(shards)} shards in {cache_dir}; this run tokenized {total:,} tokens in {elapsed:.1f}s "
          f"({total / max(elapsed, 1e-9):,.0f} tokens/s)", flush=True)
    return 0


def prepare_one_file(args) -> int:
    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    # A bar on stderr when it is a terminal; the line below reports the result either way.
    with Progress(enabled=True).counter("tokenizing", "tok") as update:
        path = write_token_file(text_files(args.input, args.pattern, args.max_bytes), tokenizer, args.output, update)
    tokens = TokenFile(path)
    print(f"{path}: {len(tokens):,} tokens ({tokens.meta['dtype']}, tokenizer {tokenizer.name}) "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", default=[], help="a data source (repeat for several)")
    parser.add_argument("--cache-dir", default="~/.cache/parallel3d", help="data.cache_dir of the runs")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="processes (default: all cores)")
    parser.add_argument("--text-field", default="text", help="data.text_field")
    parser.add_argument("--eval-fraction", type=float, default=0.0, help="eval.fraction of the runs")
    parser.add_argument("--input", help="one-file form: a folder of text files")
    parser.add_argument("--output", help="one-file form: the token file to write (.bin)")
    parser.add_argument("--pattern", default="**/*", help="one-file form: glob under --input (default: all)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    parser.add_argument("--max-bytes", type=int, default=None, help="one-file form: stop after this much text")
    args = parser.parse_args(argv)
    if args.input or args.output:
        if not (args.input and args.output):
            parser.error("the one-file form needs both --input and --output")
        return prepare_one_file(args)
    if not args.source:
        parser.error("give --source (or --input and --output)")
    try:
        return prepare(args.source, Path(args.cache_dir).expanduser(), max(args.workers, 1), args.tokenizer,
                       args.text_field, args.eval_fraction)
    except ConfigError as e:  # bad input: one line naming the file and the fix
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
