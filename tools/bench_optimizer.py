#!/usr/bin/env python
"""AdamW's implementations side by side on one device: the time of one optimizer step over a
model's parameters (its real shapes), for each of ``optim.implementation`` fused, foreach and
for_loop. Prints a Markdown block for BENCHMARKS.md.

    python tools/bench_optimizer.py [--steps 15] [--threads 1] [model=llama3_1b model.n_layers=2 ...]

All implementations start from the same parameters, gradients and state, and must compute the
same update (checked before anything is timed). CPU time of the process is reported on a CPU (one
torch thread by default: stable on a shared machine), CUDA-synchronized wall time on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from bench_common import heading, torch_threads  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from parallel3d.config import compose  # noqa: E402
from parallel3d.models import Transformer  # noqa: E402
from parallel3d.optim import implementation_flags  # noqa: E402

IMPLEMENTATIONS = ("fused", "foreach", "for_loop")


def model_params(overrides: list[str], device: torch.device) -> list[torch.nn.Parameter]:
    cfg = OmegaConf.to_object(compose([*overrides, "run_dir=."]).model)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(0)
    generator = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator, device=device) * 1e-3
    return list(model.parameters())


def optimizer_over(params, implementation: str) -> tuple[torch.optim.AdamW, list[torch.nn.Parameter]]:
    """An AdamW over copies of ``params`` (and their gradients)."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.clone()
    return torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.1, **implementation_flags(implementation, copies)), copies


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per implementation (after 3 warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on a CPU")
    parser.add_argument("overrides", nargs="*", help="model overrides, e.g. model=llama3_1b model.n_layers=2")
    args = parser.parse_args(argv)
    with torch_threads(args.threads):
        return run(args, argv)


def run(args, argv: list[str] | None) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = model_params(args.overrides, device)
    results, updated = {}, {}
    for name in IMPLEMENTATIONS:
        optimizer, copies = optimizer_over(params, name)
        optimizer.step()
        updated[name] = [c.detach().clone() for c in copies]
        for _ in range(2):
            optimizer.step()
        times = []
        for _ in range(args.steps):
            start = clock(device)
            optimizer.step()
            times.append(clock(device) - start)
        results[name] = statistics.median(times)
    worst = max((a - b).abs().max().item() for name in IMPLEMENTATIONS[1:]
                for a, b in zip(updated[name], updated["fused"]))
    if worst > 1e-6:
        print(f"the implementations disagree (largest difference after one step {worst:.1e}): no comparison")
        return 1
    n = sum(p.numel() for p in params)
    print(heading("AdamW step by implementation", "bench_optimizer.py", argv,
                  "" if device.type == "cuda" else f"{args.threads} torch thread(s)"))
    print(f"{n / 1e6:.1f}M parameters in {len(params)} tensors; after one step the implementations agree "
          f"to {worst:.1e}.\n")
    print(f"| implementation | {'CUDA ms' if device.type == 'cuda' else 'CPU ms'} per step (median) | vs fused |")
    print("|---|---|---|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1e3:.2f} | {seconds / results['fused']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
