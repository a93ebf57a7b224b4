#!/usr/bin/env python
"""A MoE training step against a dense model with the same active parameters, one process.

    python tools/bench_moe.py [--steps 12] [key=value ...]

The MoE model is ``model=tiny_moe`` (8 experts of 64, top 2, in every block); the dense one is the
same model with ``model.moe.num_experts=0`` and ``model.ffn_dim`` = top_k x expert_ffn_dim, so a
token passes the same number of feed-forward weights (the MoE adds its router: dim x experts).
Both train through ``python -m parallel3d.train`` on the same data; the table gives the median
step time over the steps after the first two (warm-up), tokens per second, and parameter counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import heading  # noqa: E402

from parallel3d.config.compose import compose
from parallel3d.models import Transformer, flops_per_token, num_params  # noqa: E402
from parallel3d.observe.metrics import read_metrics  # noqa: E402


def variants(extra: list[str]) -> dict[str, list[str]]:
    moe = OmegaConf.to_object(compose(["model=tiny_moe", *extra]).model).moe
    dense_ffn = moe.top_k * moe.expert_ffn_dim
    return {"moe": ["model=tiny_moe", *extra],
            "dense": ["model=tiny_moe", "model.moe.num_experts=0", f"model.ffn_dim={dense_ffn}", *extra]}


def train(overrides: list[str], steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        cmd = [sys.executable, "-m", "parallel3d.train", f"run_dir={run_dir}", f"train.steps={steps}",
               "optim.warmup_steps=2", *overrides]
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        return read_metrics(run_dir / "metrics.jsonl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    args, extra = parser.parse_known_args(argv)
    rows = []
    for name, overrides in variants(extra).items():
        cfg = OmegaConf.to_object(compose(overrides).model)
        with torch.device("meta"):
            total = num_params(Transformer(cfg))
        seq_len = compose(overrides).train.seq_len
        metrics = train(overrides, args.steps)[2:]
        step = statistics.median(r["step_time_s"] for r in metrics)
        tokens = statistics.median(r["tokens_per_sec"] for r in metrics)
        rows.append(f"| {name} | {total / 1e6:.2f} M | {flops_per_token(cfg, seq_len) / 6e6:.3f} M | "
                    f"{step * 1e3:.0f} ms | {tokens:,.0f} |")
    print(heading("MoE step against dense at equal active parameters, CPU, one process", "bench_moe.py", argv))
    print()
    print("| model | parameters | training FLOPs per token / 6 (active) | median step | tokens/s |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
