#!/usr/bin/env python
"""Tokenize data sources ahead of training, in parallel worker processes; resumable.

    parallel3d-prepare-data --source DATA [--source MORE ...] --cache-dir DIR [--workers N]
                            [--tokenizer byte|path/to/tokenizer.json] [--text-field text]
                            [--eval-fraction F] [--format chat|prompt_response --seq-len N ...]

Each source is what ``data.sources`` accepts (.jsonl/.jsonl.gz/.json, .parquet, folders or globs
of them, datasets.save_to_disk folders, text folders). Every shard is tokenized into DIR under
its content key, exactly as training would do on first use, so a run with the same sources,
tokenizer, text field and eval.fraction finds them done:

    python -m parallel3d.train data.sources=[DATA,MORE] data.cache_dir=DIR [eval.fraction=F]

Instruction records (docs/finetune.md) become the rows a run with the same data.format,
data.prompt_field, data.response_field, data.chat_template, data.train_on, data.packing,
data.truncation and train.seq_len reads: ``--format chat --seq-len 4096 --tokenizer DIR ...``.

Killed, it resumes: finished shards are kept, unfinished ones (never visible as finished) are
redone, and finished ones that no longer match their checksum are rebuilt. Its workers end with
it (even on kill -9); SIGTERM or Ctrl-C stops them with one line. The one-file form of earlier
versions still works:

    parallel3d-prepare-data --input DIR --output corpus.bin [--pattern "**/*.txt"]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

from parallel3d.base import ConfigError
from parallel3d.config.schema import DataConfig
from parallel3d.data import TokenFile, load_tokenizer, text_files, write_token_file
from parallel3d.data.checks import check_instruction_data
from parallel3d.data.sft import SFTSpec
from parallel3d.data.shards import cache_problem, shard_files, tokenize_shard
from parallel3d.data.sources import resolve
from parallel3d.progress import Progress

TMP_FILE = re.compile(r"^\..+\.(\d+)(\.json)?\.tmp$")  # write_token_file's temporary names carry the pid


def _tokenize(task):
    """In a worker: check a done shard against its manifest (rebuilt if it no longer matches) or
    tokenize a missing one. Returns the shard, its files, its training and held-out token counts,
    the seconds it took and whether it was tokenized now."""
    shard, files, tokenizer_spec, text_field, fraction, sft = task
    start = time.perf_counter()
    problem = cache_problem(files) if files.done() else None
    if problem:
        print(f"prepare_data: rebuilding cached tokens {problem}", file=sys.stderr, flush=True)
    tokenized = problem is not None or not files.done()
    if tokenized:
        tokenize_shard(shard, files, load_tokenizer(tokenizer_spec), text_field, fraction, f"worker {os.getpid()}",
                       sft=sft)
    heldout = 0 if files.heldout is None else len(TokenFile(files.heldout))
    return shard, files, len(TokenFile(files.train)), heldout, time.perf_counter() - start, tokenized


def _worker_start(parent: int) -> None:
    """Pool initializer: a worker ends with its parent (a kill -9 of prepare_data, a lost session)
    instead of tokenizing on as an orphan; signals are the parent's to handle."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # Pool.terminate() ends workers with SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops them
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:  # no parent-death signal: watch for the re-parenting instead
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


class Terminated(BaseException):
    """SIGTERM (or Ctrl-C) while tokenizing: stop the workers and say what is kept."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum, frame):
    raise Terminated(signum)


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
            fraction: float, sft: SFTSpec | None = None) -> int:
    tokenizer = load_tokenizer(tokenizer_spec)
    shards = [s for source in sources for s in resolve(source)]
    files = [shard_files(s, tokenizer, text_field, fraction, cache_dir, sft) for s in shards]
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(cache_dir)
    tasks = [(s, f, tokenizer_spec, text_field, fraction, sft) for s, f in zip(shards, files)]
    done = sum(f.done() for f in files)
    print(f"{done} of {len(shards)} shards already done; tokenizing {len(shards) - done} "
          f"with {workers} worker{'s' * (workers > 1)} into {cache_dir}", flush=True)
    start, total, heldout, finished = time.perf_counter(), 0, 0, 0
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        with Progress(enabled=True).counter("tokenizing", "shard") as update:
            # fork: the workers inherit the imports; each encodes on one core (no tokenizer threads).
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            with multiprocessing.get_context("fork").Pool(workers, _worker_start, (os.getpid(),)) as pool:
                for finished, result in enumerate(pool.imap_unordered(_tokenize, tasks), 1):
                    shard, shard_out, tokens, held, seconds, tokenized = result
                    update(finished)
                    heldout += held
                    if tokenized:
                        total += tokens
                        print(f"tokenized {shard.path} -> {shard_out.train.name}: {tokens:,} tokens in "
                              f"{seconds:.1f}s", flush=True)
    except (Terminated, KeyboardInterrupt) as e:  # the pool is terminated on leaving its with-block
        _remove_abandoned(cache_dir)
        name = signal.Signals(e.signum).name if isinstance(e, Terminated) else "Ctrl-C"
        print(f"prepare_data: stopped by {name}: {sum(f.done() for f in files)} of {len(shards)} shards are done "
              f"and kept in {cache_dir}; run the same command again to tokenize the rest", file=sys.stderr,
              flush=True)
        return 128 + (e.signum if isinstance(e, Terminated) else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.perf_counter() - start
    print(f"done: {len(shards)} shards in {cache_dir}; this run tokenized {total:,} tokens in {elapsed:.1f}s "
          f"({total / max(elapsed, 1e-9):,.0f} tokens/s)", flush=True)
    if fraction > 0 and heldout == 0:
        print(f"prepare_data: warning: --eval-fraction {fraction} held out no document of these sources (each "
              f"is held out with that chance): a run with eval.fraction={fraction} stops with a config error. "
              f"Raise it, or give held-out files in eval.sources", file=sys.stderr, flush=True)
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


def instruction_spec(args) -> SFTSpec | None:
    """The rows' settings as a run's data.* keys would give them (checked as validation checks them)."""
    data = DataConfig(sources=args.source, tokenizer=args.tokenizer, format=args.format, packing=args.packing,
                      **{k: getattr(args, k) for k in ("prompt_field", "response_field", "chat_template", "train_on",
                                                       "truncation")})
    check_instruction_data(data)
    return SFTSpec.from_config(data, args.seq_len)


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
    instruction = parser.add_argument_group("instruction data (the data.* keys of the runs; docs/finetune.md)")
    instruction.add_argument("--format", default="text", choices=["text", "prompt_response", "chat"])
    instruction.add_argument("--seq-len", type=int, help="train.seq_len of the runs (rows of seq_len + 1)")
    for key in ("prompt_field", "response_field", "chat_template", "train_on", "truncation"):
        instruction.add_argument(f"--{key.replace('_', '-')}", default=getattr(DataConfig, key), help=f"data.{key}")
    instruction.add_argument("--no-packing", dest="packing", action="store_false", help="data.packing=false")
    args = parser.parse_args(argv)
    if args.input or args.output:
        if not (args.input and args.output):
            parser.error("the one-file form needs both --input and --output")
        return prepare_one_file(args)
    if not args.source:
        parser.error("give --source (or --input and --output)")
    if args.format != "text" and not args.seq_len:
        parser.error(f"--format {args.format} lays records out in rows of train.seq_len + 1: give --seq-len")
    try:
        return prepare(args.source, Path(args.cache_dir).expanduser(), max(args.workers, 1), args.tokenizer,
                       args.text_field, args.eval_fraction, instruction_spec(args))
    except ConfigError as e:  # bad input: one line naming the file and the fix
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
