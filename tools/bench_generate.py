#!/usr/bin/env python
"""Batched generation: the whole ``parallel3d-generate --prompts-file`` command at batch 1 and batch B.

    python tools/bench_generate.py [--prompts 128] [--new-tokens 128] [--batch-size 16] [--runs 3]

Writes the tiny model (conf/model/tiny.yaml, seeded random weights) as a Hugging Face folder and a
prompts file of ``--prompts`` prompts of token ids, log-uniform lengths 8-256 (a fixed seed), then
runs the command, as a user would, on each batch size in turn (batch 1, batch B, batch 1, ...) with
one torch thread (``OMP_NUM_THREADS=1``), ``--max-new-tokens --new-tokens --token-ids --device cpu``.
Each run is timed from outside: wall seconds from start to exit and the child's CPU seconds (user +
system), start-up, model load and all. Tokens per second are the generated tokens (counted in what
it printed) over those seconds, the median run of each batch size; the runs must print the same ids
at every batch size (else the tool says so and fails). Prints a Markdown block for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import heading
from omegaconf import OmegaConf
from safetensors.torch import save_file

from parallel3d.config.compose import compose
from parallel3d.config.schema import ModelConfig
from parallel3d.hf import families
from parallel3d.models import Transformer


def write_tiny_folder(folder: Path) -> None:
    """The tiny model with seeded random weights, as a Hugging Face folder (no tokenizer: ids in and out)."""
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), compose([]).model))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    weights = {key: t.contiguous() for name, p in model.named_parameters()
               for key, t in families.hf_tensors(name, p.detach(), cfg).items()}
    folder.mkdir(parents=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(families.hf_config(cfg, torch.float32)))


def write_prompts(path: Path, count: int, vocab: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            length = int(math.exp(rng.uniform(math.log(8), math.log(256))))
            f.write(json.dumps({"prompt_ids": [rng.randrange(vocab) for _ in range(length)]}) + "\n")


def run_command(command: list[str]) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds (user + system, of the child and anything it waited for) and the
    standard output of one whole run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run(command, capture_output=True, env=env, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"the command failed: {' '.join(command)}\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu, proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder, prompts = Path(tmp) / "tiny", Path(tmp) / "prompts.jsonl"
        write_tiny_folder(folder)
        write_prompts(prompts, args.prompts, compose([]).model.vocab_size)
        base = [sys.executable, "-m", "parallel3d.cli.generate", str(folder), "--prompts-file", str(prompts),
                "--max-new-tokens", str(args.new_tokens), "--token-ids", "--device", "cpu"]
        sizes = [1, args.batch_size]
        runs: dict[int, list[tuple[float, float]]] = {b: [] for b in sizes}
        printed: dict[int, str] = {}
        for _ in range(args.runs):
            for b in sizes:
                wall, cpu, out = run_command([*base, "--batch-size", str(b)])
                runs[b].append((wall, cpu))
                printed.setdefault(b, out)
    if len(set(printed.values())) != 1:
        print(f"batch {args.batch_size} printed other ids than batch 1: not comparable")
        return 1
    tokens = sum(len(line.split()) for line in printed[1].splitlines())
    lines = ["| --batch-size | generated tokens | wall s | CPU s | tokens per wall s | tokens per CPU s |",
             "|---:|---:|---:|---:|---:|---:|"]
    rates = {}
    for b in sizes:
        wall, cpu = statistics.median(w for w, _ in runs[b]), statistics.median(c for _, c in runs[b])
        rates[b] = (tokens / wall, tokens / cpu)
        lines.append(f"| {b} | {tokens:,} | {wall:.1f} | {cpu:.1f} | {tokens / wall:,.0f} | {tokens / cpu:,.0f} |")
    ratio_wall, ratio_cpu = (rates[args.batch_size][i] / rates[1][i] for i in (0, 1))
    print(heading("Batched generation, whole command", "bench_generate.py", argv,
                  f"one torch thread, median of {args.runs} runs each") + "\n")
    print("\n".join(lines))
    print(f"\nBatch {args.batch_size} against batch 1: {ratio_wall:.2f}x the tokens per wall second, "
          f"{ratio_cpu:.2f}x per CPU second; the same ids.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
