#!/usr/bin/env python
"""Fine-tuning throughput: the same instruction records trained packed and padded.

    python tools/bench_sft.py [--records 2000] [--steps 10] [key=value ...]

Writes prompt/response records of varied length (prompts and responses 16-1024 bytes each,
log-uniform, a fixed seed), then trains the tiny model on them in this process, byte tokens,
``train.seq_len=512``, global batch 16, ``data.packing=true`` (best fit: parallel3d/data/packing.py)
and ``false``. A row costs about the same either way (packed rows add the per-sample attention
mask); what differs is how much of it is padding. For comparison it also prints the fill greedy
packing in file order (a row closed at the first sample that does not fit) gives the same samples. Each setting trains ``--steps`` and then ``2 x --steps`` steps from scratch on
rows built beforehand; the difference of the two runs' CPU time, divided by ``--steps``, is the
CPU time of a step with start-up cancelled out (one torch thread: CPU time barely moves with the
machine's load, wall time does). Reported: rows and tokens per CPU second, where sample tokens
are the rows' non-padding tokens and trained tokens those with a loss (the assistant replies and
EOS), both from the rows files' manifests (averaged over all rows). Prints a Markdown block for
BENCHMARKS.md (date, machine, command, numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import heading, torch_threads

from parallel3d.config.compose import compose
from parallel3d.data.corpus import open_sources
from parallel3d.train import train

WORDS = "the of and to in is that for it as with was on be by this are from at or an have not which".split()


def write_records(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        size = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        words = []
        while sum(len(w) + 1 for w in words) < size:
            words.append(rng.choice(WORDS))
        return " ".join(words)

    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": text(16, 1024), "response": text(16, 1024)}) + "\n")


def cpu_per_step(overrides: list[str], steps: int, root: Path) -> float:
    """CPU seconds of one training step: runs of ``steps`` and ``2 x steps``, differenced."""
    seconds = []
    for n in (steps, 2 * steps):
        start = time.process_time()
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            train(compose([*overrides, f"train.steps={n}", f"run_dir={root / f'run{n}'}"]))
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        seconds.append(time.process_time() - start)
    return (seconds[1] - seconds[0]) / steps


def rows_manifests(cache: Path, rows_of: int, packing: bool) -> dict:
    """Summed counts of the rows files built for these settings (the cache holds both runs')."""
    totals = {"rows": 0, "sample_tokens": 0, "trained_tokens": 0}
    for meta_path in cache.glob("*.json"):
        meta = json.loads(meta_path.read_text())
        if meta.get("rows_of") == rows_of and meta.get("packing") == packing and meta["dtype"] != "uint8":
            for key in totals:
                totals[key] += meta[key]
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    lines = ["| data.packing | CPU time per step | rows per CPU s | sample share of row tokens | sample tokens per CPU s "
             "| trained tokens per CPU s |", "|---|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp, torch_threads(1):
        root = Path(tmp)
        write_records(root / "records.jsonl", args.records, seed=0)
        base = [f"data.sources=[{root / 'records.jsonl'}]", "data.format=prompt_response",
                f"data.cache_dir={root / 'cache'}", "train.seq_len=512", "train.global_batch_size=16",
                "train.micro_batch_size=4", "train.device=cpu", "model.vocab_size=512", *args.overrides]
        for packing in (True, False):
            overrides = [*base, f"data.packing={str(packing).lower()}"]
            c = compose(overrides)
            with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
                open_sources(list(c.data.sources), c.data, 0.0, seq_len=c.train.seq_len)  # the rows, untimed
            step = cpu_per_step(overrides, args.steps, root / f"packing-{packing}")
            rows = rows_manifests(root / "cache", c.train.seq_len + 1, packing)
            width = c.train.seq_len + 1
            share = rows["sample_tokens"] / (rows["rows"] * width)
            per_s = c.train.global_batch_size / step
            lines.append(f"| {str(packing).lower()} | {step * 1000:.0f} ms | {per_s:.1f} | {share:.1%} | "
                         f"{per_s * share * width:,.0f} | {per_s * rows['trained_tokens'] / rows['rows']:,.0f} |")
        greedy = greedy_fill(root / "records.jsonl", compose(base))
    print(heading("Fine-tuning: packed vs padded rows", "bench_sft.py", argv, "one torch thread, CPU time") + "\n")
    print("\n".join(lines))
    print(f"\nGreedy packing in file order would fill the rows of the same samples to {greedy:.1%}.")
    return 0


def greedy_fill(records: Path, c) -> float:
    """Sample tokens / row tokens of the rows greedy packing in file order makes (the packer before
    best fit): each sample joins the current row, or closes it and starts the next."""
    from parallel3d.data.shards import rendered
    from parallel3d.data.sft import SFTSpec, records as read_records
    from parallel3d.data.sources import resolve
    from parallel3d.data.tokenizer import load_tokenizer

    spec, tokenizer = SFTSpec.from_config(c.data, c.train.seq_len), load_tokenizer(c.data.tokenizer)
    width = c.train.seq_len + 1
    lengths = [min(len(rendered(shard, i, r, spec, tokenizer)[0]), width)
               for shard in resolve(str(records)) for i, r in enumerate(read_records(shard, spec.fields))]
    rows, used = 0, 0
    for length in lengths:
        if used and used + length > width:
            rows, used = rows + 1, 0
        used += length
    return sum(lengths) / ((rows + bool(used)) * width)


if __name__ == "__main__":
    sys.exit(main())
