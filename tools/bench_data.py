#!/usr/bin/env python
"""Data-path benchmark: tokenization throughput by worker count, and the time a step waits for data.

    python tools/bench_data.py [--shards 8] [--mb-per-shard 2] [--workers 1 2 4] [--steps 20]

Writes a corpus of jsonl shards (this Python's standard library sources as documents), trains
a BPE tokenizer of 8k tokens on a sample of it (no download), then measures
  * the tokenizer's own batch encode (``Tokenizer.encode_batch``) on one core and on all cores,
  * parallel3d-prepare-data's path (read, encode, write the token files) with 1, 2, ... workers,
  * ``data_wait_s`` of a short training run of the tiny model on those shards.
Prints markdown tables for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_corpus(root: Path, shards: int, mb_per_shard: float) -> list[str]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    texts = (p.read_text(encoding="utf-8", errors="replace") for p in files)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(shards):
        size, lines = 0, []
        for text in texts:
            lines.append(json.dumps({"text": text}) + "\n")
            size += len(text)
            if size >= mb_per_shard * 1e6:
                break
        (root / f"part-{i:03d}.jsonl").write_text("".join(lines))
    return [str(root)]


def train_tokenizer(out: Path, sample: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample, trainer)
    tok.save(str(out))
    return out


def batch_encode_rate(tokenizer_path: Path, texts: list[str], threads: str) -> tuple[float, float]:
    """Tokens per wall second and per CPU second of Tokenizer.encode_batch, in a fresh process
    (the thread setting is read once)."""
    code = ("import sys,time,json; from tokenizers import Tokenizer; t=Tokenizer.from_file(sys.argv[1]); "
            "x=json.load(open(sys.argv[2])); s=time.perf_counter(); c=time.process_time(); "
            "e=t.encode_batch(x, add_special_tokens=False); n=sum(len(i.ids) for i in e); "
            "print(n/(time.perf_counter()-s), n/(time.process_time()-c))")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(texts, f)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false" if threads == "1" else "true"}
    if threads != "1":
        env.pop("RAYON_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code, str(tokenizer_path), f.name], capture_output=True, text=True,
                         env=env, check=True)
    wall, cpu = out.stdout.split()
    return float(wall), float(cpu)


def prepare_rate(sources: list[str], tokenizer: Path, workers: int, cache: Path) -> tuple[float, float]:
    """Tokens per wall second and per CPU second (the tool and its workers, start-up included)."""
    start, cpu = time.perf_counter(), _children_cpu_s()
    subprocess.run([sys.executable, "-m", "parallel3d.cli.prepare_data", *[a for s in sources for a in ("--source", s)],
                          "--cache-dir", str(cache), "--workers", str(workers), "--tokenizer", str(tokenizer)],
                         cwd=ROOT, capture_output=True, text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    wall, cpu = time.perf_counter() - start, _children_cpu_s() - cpu
    tokens = sum(json.loads(p.read_text())["num_tokens"] for p in cache.glob("*.json"))
    return tokens / wall, tokens / cpu


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for descendants: the pool's workers too
    return usage.ru_utime + usage.ru_stime


def data_wait(sources: list[str], tokenizer: Path, cache: Path, steps: int, run_dir: Path) -> tuple[float, float]:
    args = [sys.executable, "-m", "parallel3d.train", f"run_dir={run_dir}", f"data.sources=[{','.join(sources)}]",
            f"data.cache_dir={cache}", f"data.tokenizer={tokenizer}", "model.vocab_size=8192",
            f"train.steps={steps}", "optim.warmup_steps=2", "train.seq_len=256"]
    subprocess.run(args, cwd=run_dir.parent, capture_output=True, text=True, check=True,
                   env={**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    from parallel3d.observe.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")[1:]  # after step 1
    return (sum(r["data_wait_s"] for r in rows) / len(rows), sum(r["step_time_s"] for r in rows) / len(rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--mb-per-shard", type=float, default=2.0)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sources = write_corpus(root / "src", args.shards, args.mb_per_shard)
        first = [json.loads(line)["text"] for line in (root / "src" / "part-000.jsonl").read_text().splitlines()]
        tokenizer = train_tokenizer(root / "tokenizer.json", first[:200])
        print(f"corpus: {args.shards} jsonl shards of ~{args.mb_per_shard} MB (stdlib sources), BPE 8k tokenizer; "
              f"{os.cpu_count()} cores\n")
        print("| what | tokens per wall second | tokens per CPU second |\n|---|---:|---:|")
        for threads in ("1", "all"):
            wall, cpu = batch_encode_rate(tokenizer, first, threads)
            print(f"| Tokenizer.encode_batch, {threads} thread{'s' if threads != '1' else ''} (shard 0 in memory) "
                  f"| {wall:,.0f} | {cpu:,.0f} |")
        for workers in args.workers:
            wall, cpu = prepare_rate(sources, tokenizer, workers, root / f"cache-{workers}")
            print(f"| prepare_data.py --workers {workers} (read + encode + write, {args.shards} shards) "
                  f"| {wall:,.0f} | {cpu:,.0f} |")
        wait, step = data_wait(sources, tokenizer, root / "cache-1", args.steps, root / "run")
        print(f"\ndata wait per step (tiny model, seq 256, batch 16, one process, steps 2-{args.steps}): "
              f"{wait * 1e3:.2f} ms of a {step * 1e3:.0f} ms step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
