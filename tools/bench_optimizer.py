#!/usr/bin/env python
"""AdamW's implementations side by side on one device: the time of one optimizer step over a
model's parameters (its real shapes), for each of ``optim.implementation`` fused, foreach and
for_loop. Prints a Markdown block for BENCHMARKS.md.

    python tools/bench_optimizer.py [--steps 15] [--threads 1] [model=llama3_1b model.n_layers=2 ...]

``--muon``: Muon against AdamW in one layout, on every rank of a torchrun group: the real
parallelized model of ``build_setup`` (FSDP, tp, pp, ep as the overrides say), gradients from one
training step, then the median wall time of ``optimizer.step()`` (the slowest rank's), for
``optim.name=adamw`` and ``muon``, of Muon's exchange alone (pieces to their owners and back,
without Newton–Schulz), and the bytes the planner counts for that exchange. Prints one Markdown
table row.

    torchrun --nproc-per-node 4 tools/bench_optimizer.py --muon [--steps 5] parallel.tp=2 ...

``--step-time``: the whole training step (under Muon, or ``--optim``; the overrides apply to both),
one process against a torchrun group of ``--nproc`` ranks in ``--layout`` (``OMP_NUM_THREADS=1``
for both): the median ``step_time_s`` of metrics.jsonl after two warm-up steps, in ``--repeats``
pairs of runs (one process, then the layout, so that both meet the same load on a shared
machine), the median of each and the pairs' ratios; the same for the CPU seconds a step costs each rank (which another
job's load on a shared machine leaves nearly alone, unlike wall time); and the load average
while they ran. Prints one Markdown table row.

    python tools/bench_optimizer.py --step-time [--steps 12] [--repeats 3] [--nproc 2] \
        [--layout "parallel.zero_stage=3"] [--optim adamw_cosine] [model.dim=256 ...]

All implementations start from the same parameters, gradients and state, and must compute the
same update (checked before anything is timed). CPU time of the process is reported on a CPU (one
torch thread by default: stable on a shared machine), CUDA-synchronized wall time on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import torch  # noqa: E402
from bench_common import heading, torch_threads  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from parallel3d.config.compose import compose
from parallel3d.models import Transformer  # noqa: E402
from parallel3d.optim.adamw import implementation_flags  # noqa: E402

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
    parser.add_argument("--muon", action="store_true", help="Muon against AdamW in the layout the overrides give")
    parser.add_argument("--step-time", action="store_true", help="Muon's training step: one process against --nproc")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the layout --step-time compares")
    parser.add_argument("--optim", default="muon_cosine", help="--step-time: the optimizer (conf/optim/)")
    parser.add_argument("--layout", default="parallel.zero_stage=3", help="--step-time: the layout's overrides")
    parser.add_argument("--repeats", type=int, default=3, help="--step-time: pairs of runs (one process, the layout)")
    parser.add_argument("overrides", nargs="*", help="model overrides, e.g. model=llama3_1b model.n_layers=2")
    args = parser.parse_args(argv)
    if args.step_time:
        return step_time_against_one_process(args)
    with torch_threads(args.threads):
        return muon_against_adamw(args) if args.muon else run(args, argv)


def step_seconds(overrides: list[str], steps: int) -> tuple[float, float]:
    """Median wall times (the slowest rank's) of ``optimizer.step()`` after one training step, and of
    Muon's exchange alone (0 under AdamW)."""
    import torch.distributed as dist

    from parallel3d.step import build_setup, train_step
    from parallel3d.validate import check

    world = dist.get_world_size() if dist.is_initialized() else 1
    c = OmegaConf.to_object(check(compose([*overrides, "run_dir=."]), world))
    setup = build_setup(c, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    t = c.train
    batches = [(torch.randint(0, c.model.vocab_size, (t.micro_batch_size, t.seq_len), generator=g),) * 2
               for _ in range(setup.spec.num_micro_batches)]
    train_step(setup, batches)  # gradients, and the optimizer state (its first step)
    if c.optim.name != "muon":
        return _median_seconds(setup.optimizer.step, steps), 0.0
    muon = setup.optimizer.muon
    matrices = muon.param_groups[0]["params"]
    updates = [(p.to_local() if hasattr(p, "to_local") else p).detach().bfloat16() for p in matrices]
    # Muon's exchange alone: every piece to its matrix's owner and back, Newton–Schulz left out.
    exchange = partial(muon.orthogonaliser, matrices, updates, lambda matrix, item: matrix)
    return _median_seconds(setup.optimizer.step, steps), _median_seconds(exchange, steps)


def _median_seconds(fn, steps: int) -> float:
    """Median wall time of ``fn()`` over ``steps`` calls, the slowest rank's each time."""
    import torch.distributed as dist

    times = []
    for _ in range(steps):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor(time.perf_counter() - start)
        if dist.is_initialized():
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return statistics.median(times)


def muon_against_adamw(args) -> int:
    import os

    from parallel3d.planner import predict
    from parallel3d.runtime.process_group import init_distributed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    init_distributed(compose([*args.overrides, "run_dir=."]).train, world)
    adamw, _ = step_seconds([*args.overrides, "optim=adamw_cosine"], args.steps)
    muon, exchange = step_seconds([*args.overrides, "optim=muon_cosine"], args.steps)
    traffic = [predict(compose([*args.overrides, f"optim={name}", "run_dir=."]), world).comm_bytes
               for name in ("adamw_cosine", "muon_cosine")]
    extra = sum(v for group in traffic[1].values() for v in group.values()) - \
        sum(v for group in traffic[0].values() for v in group.values())
    if int(os.environ.get("RANK", "0")) == 0:
        layout = " ".join(args.overrides) or "one process"
        print(f"| {world} | {layout} | {adamw * 1e3:.1f} | {muon * 1e3:.1f} | {exchange * 1e3:.1f} | "
              f"{extra / 1e6:.3f} |")
    return 0


def train_run(overrides: list[str], steps: int, nproc: int) -> tuple[float, float]:
    """A training run of ``nproc`` ranks (``overrides`` name the optimizer): its median
    ``step_time_s`` after two warm-up steps (none: 0), and the CPU seconds all its processes used
    (start-up included)."""
    import os
    import resource
    import subprocess
    import tempfile

    from parallel3d.observe.metrics import read_metrics

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    with tempfile.TemporaryDirectory() as tmp:
        command = [*(launcher if nproc > 1 else [sys.executable]), "-m", "parallel3d.train", f"run_dir={tmp}/run",
                   f"train.steps={steps}", "optim.warmup_steps=1", *overrides]
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(command, check=True, capture_output=True, env=env)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        timed = [r["step_time_s"] for r in read_metrics(Path(tmp) / "run" / "metrics.jsonl")[2:]]
        return statistics.median(timed) if timed else 0.0, cpu


def step_cost(overrides: list[str], steps: int, nproc: int) -> tuple[float, float]:
    """Median ``step_time_s`` and CPU seconds per step and rank: the CPU of a run of ``steps``
    less that of a run of 2, over the steps between and the ranks (start-up cancels out)."""
    wall, cpu = train_run(overrides, steps, nproc)
    _, start = train_run(overrides, 2, nproc)
    return wall, (cpu - start) / (steps - 2) / nproc


def step_time_against_one_process(args) -> int:
    """``--repeats`` pairs, one process then the layout, so that both meet the same load; the
    median of each and of the pairs' ratios, wall and CPU."""
    import os

    loads, pairs = [os.getloadavg()[0]], []
    both = [f"optim={args.optim}", *args.overrides]
    for _ in range(args.repeats):
        one, layout = step_cost(both, args.steps, 1), step_cost([*both, *args.layout.split()], args.steps, args.nproc)
        pairs.append((*one, *layout))
        loads.append(os.getloadavg()[0])
    one, one_cpu, layout, layout_cpu = (statistics.median(column) for column in zip(*pairs))
    ratios = [b / a for a, _, b, _ in pairs]
    cpu_ratio = statistics.median(d / c for _, c, _, d in pairs)
    print(f"| {args.optim} {' '.join(args.overrides)} | {args.layout} | {args.nproc} | {one:.3f} | {layout:.3f} | "
          f"{statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) | {one_cpu:.3f} | "
          f"{layout_cpu:.3f} | {cpu_ratio:.2f}x | "
          f"{min(loads):.1f}-{max(loads):.1f} |")
    return 0


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
