#!/usr/bin/env python
"""Framework overhead at one rank: parallel3d's training loop against a plain PyTorch loop of
the same model, batches, optimizer and schedule, timed side by side in one process.

    python tools/bench_overhead.py [--repeats 3] [--skip 5] [key=value ...]

The plain loop is what a user would write by hand (nanoGPT style): the model, AdamW, LambdaLR,
cross-entropy, clip_grad_norm_, ``loss.item()`` when logging. Both read the same batches from
the same sampler and start from the same weights, so their losses must agree; the tool checks
that before it reports a time. The two loops alternate ``--repeats`` times; each reports the
median step time over the steps after the first ``--skip``. Prints a Markdown block for
BENCHMARKS.md (date, machine, command, numbers).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from parallel3d.config import compose
from parallel3d.data import BatchSpec, StepSampler, open_corpus
from parallel3d.models import Transformer
from parallel3d.optim import build_lr_scheduler
from parallel3d.train import train


def ours(overrides: list[str], run_dir: Path) -> tuple[list[float], list[float]]:
    """parallel3d's loop: (per-step times, losses) from the metrics.jsonl it wrote."""
    train(compose([*overrides, f"run_dir={run_dir}"]))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows], [r["loss"] for r in rows]


def plain(overrides: list[str]) -> tuple[list[float], list[float]]:
    """The same training, written out by hand on one device."""
    c = OmegaConf.to_object(compose([*overrides, "run_dir=unused"]))
    t, device = c.train, torch.device("cuda" if torch.cuda.is_available() and c.train.device != "cpu" else "cpu")
    torch.manual_seed(t.seed)
    with torch.device("meta"):
        model = Transformer(c.model)
    model.to_empty(device=device)
    model.init_weights(t.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=c.optim.lr, betas=(c.optim.beta1, c.optim.beta2),
                                  eps=c.optim.eps, weight_decay=c.optim.weight_decay)
    scheduler = build_lr_scheduler(optimizer, c.optim, t.steps)
    sampler = StepSampler(open_corpus(c.data).tokens, BatchSpec(t.global_batch_size, t.micro_batch_size, t.seq_len),
                          t.seed)
    tokens = t.global_batch_size * t.seq_len
    times, losses = [], []
    for step in range(1, t.steps + 1):
        start = time.perf_counter()
        total = torch.zeros((), device=device)
        for inputs, targets in sampler.micro_batches(step):
            inputs, targets = inputs.to(device), targets.to(device)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / tokens
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % c.logging.log_every == 0 or step == t.steps:
            losses.append(total.item())  # the one host sync, when logging, as in parallel3d
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times, losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each loop")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. train.steps=60")
    args = parser.parse_args(argv)
    overrides = ["train.steps=40", "logging.log_every=1", *args.overrides]

    medians = {"parallel3d": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            times, ours_losses = ours(overrides, Path(tmp) / f"run{repeat}")
            medians["parallel3d"].append(statistics.median(times[args.skip:]))
            times, plain_losses = plain(overrides)
            medians["plain"].append(statistics.median(times[args.skip:]))
            worst = max(abs(a - b) / abs(b) for a, b in zip(ours_losses, plain_losses))
            if len(ours_losses) != len(plain_losses) or worst > 1e-5:
                print(f"the loops trained differently (relative loss difference {worst:.1e}): no comparison")
                return 1
    best = {name: min(values) for name, values in medians.items()}  # the least disturbed repeat
    overhead = best["parallel3d"] / best["plain"] - 1
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{platform.processor() or 'CPU'}"
    print(f"### Framework overhead, one rank ({date.today().isoformat()})\n")
    print(f"Machine: {platform.node()}, {device}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"Python {platform.python_version()}  ")
    print(f"Command: `python tools/bench_overhead.py {' '.join(sys.argv[1:] if argv is None else argv)}`  ")
    print(f"Losses of the two loops agree to {worst:.1e} (relative).\n")
    print("| loop | median step time per repeat (ms) | best (ms) |\n|---|---|---|")
    for name, values in medians.items():
        print(f"| {name} | {', '.join(f'{v * 1e3:.2f}' for v in values)} | {best[name] * 1e3:.2f} |")
    print(f"\nOverhead: {overhead * 100:+.1f}% (target: at most +3%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
