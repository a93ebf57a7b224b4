#!/usr/bin/env python
"""Fine-tuning throughput: the same instruction records trained packed and padded.

    python tools/bench_sft.py [--records 2000] [--steps 30] [key=value ...]

Writes prompt/response records of varied length (prompts 16-256 bytes, responses 16-1024 bytes,
log-uniform, a fixed seed), then trains the tiny model on them twice in a process of its own
each, ``data.packing=true`` and ``false``, byte tokens, ``train.seq_len=512`` unless overridden.
A row costs the same either way; what differs is how much of it is padding. Reported per run:
rows per second (the run's ``tokens_per_sec`` / (seq_len)), the share of row tokens that are
samples (from the rows files' manifests), and sample and trained tokens per second (the rows'
rate times those shares, averaged over the rows files). Step times are medians over the steps
after the first two. Prints a Markdown block for BENCHMARKS.md (date, machine, command, numbers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import heading

ROOT = Path(__file__).resolve().parent.parent
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
            f.write(json.dumps({"prompt": text(16, 256), "response": text(16, 1024)}) + "\n")


def train(root: Path, name: str, overrides: list[str]) -> dict:
    """One run in its own process; its metrics and its rows' manifests."""
    run_dir = root / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    subprocess.run([sys.executable, "-m", "parallel3d.train", f"run_dir={run_dir}", *overrides], check=True,
                   env=env, cwd=root, capture_output=True, text=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"metrics": metrics}


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
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_records(root / "records.jsonl", args.records, seed=0)
        base = [f"data.sources=[{root / 'records.jsonl'}]", "data.format=prompt_response", f"data.cache_dir={root / 'cache'}",
                f"train.steps={args.steps}", "train.seq_len=512", "train.global_batch_size=16",
                "train.micro_batch_size=4", "model.vocab_size=512", *args.overrides]
        seq_len = int(next((o.split("=")[1] for o in reversed(base) if o.startswith("train.seq_len=")), 512))
        lines = ["| data.packing | rows/s | sample share of row tokens | sample tokens/s | trained tokens/s | step time |",
                 "|---|---:|---:|---:|---:|---:|"]
        for packing in (True, False):
            run = train(root, f"packing-{packing}", [*base, f"data.packing={str(packing).lower()}"])
            timed = run["metrics"][2:] or run["metrics"]
            rate = statistics.median(m["tokens_per_sec"] for m in timed) / seq_len
            step = statistics.median(m["step_time_s"] for m in timed)
            rows = rows_manifests(root / "cache", seq_len + 1, packing)
            share = rows["sample_tokens"] / (rows["rows"] * (seq_len + 1))
            trained = rows["trained_tokens"] / rows["rows"]
            lines.append(f"| {str(packing).lower()} | {rate:.1f} | {share:.1%} | {rate * share * (seq_len + 1):,.0f} | "
                         f"{rate * trained:,.0f} | {step * 1000:.0f} ms |")
    print(heading("Fine-tuning: packed vs padded rows", "bench_sft.py", argv) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
