#!/usr/bin/env python
"""Framework overhead at one rank: parallel3d's training loop against a plain PyTorch loop of
the same model, batches, optimizer and schedule, measured side by side in one process.

    python tools/bench_overhead.py [--repeats 5] [--steps 20] [--threads 1] [key=value ...]

The plain loop is what a user would write by hand (nanoGPT style): the model, fused AdamW (as
parallel3d's default), LambdaLR, cross-entropy, clip_grad_norm_, ``loss.item()`` when logging.
Both read the same batches from the same sampler and start from the same weights, so their
losses must agree; the tool checks that before it reports a time.

What is timed: the cost of a step, set-up excluded. Each loop trains ``--steps`` and then
``2 x --steps`` steps from scratch; the difference of the two, divided by ``--steps``, is the
per-step cost with model building, data opening and the first step's warm-up cancelled out.
Both the CPU time of the process and the wall time are reported: on a shared machine wall time
swings with other jobs by tens of percent, while CPU time with one torch thread barely moves,
so CPU time decides the verdict (on a GPU run wall time is what counts: there the host only
queues kernels). The loops alternate in order repeat by repeat; medians over repeats are
reported. Prints a Markdown block for BENCHMARKS.md (date, machine, command, numbers).

    python tools/bench_overhead.py --instructions [--steps 10] [key=value ...]

counts instructions instead (valgrind's callgrind, each run in a process of its own, hash seed
fixed): the same differencing, but a count that does not move with the machine's load, so it
resolves differences of a fraction of a percent where CPU time on a shared machine moves by ten.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import heading, torch_threads
from omegaconf import OmegaConf

from parallel3d.base import DTYPES
from parallel3d.config.compose import compose
from parallel3d.data import BatchSpec, StepSampler, open_corpus
from parallel3d.models import Transformer
from parallel3d.observe.metrics import read_metrics  # noqa: E402
from parallel3d.optim.adamw import decay_groups
from parallel3d.optim.schedule import build_lr_scheduler
from parallel3d.train import train


def ours(overrides: list[str], run_dir: Path) -> list[float]:
    """parallel3d's loop; its losses."""
    return [record["loss"] for record in ours_records(overrides, run_dir)]


def ours_records(overrides: list[str], run_dir: Path) -> list[dict]:
    """parallel3d's loop (its console lines discarded: the tools print a report); the records of
    the metrics.jsonl it wrote."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        train(compose([*overrides, f"run_dir={run_dir}"]))
    if torch.distributed.is_initialized():  # below float32 one process has a group of one rank (mesh.py)
        torch.distributed.destroy_process_group()  # which run_job, not train(), tears down
    return read_metrics(run_dir / "metrics.jsonl")


def plain(overrides: list[str], run_dir: Path) -> list[float]:
    """The same training, written out by hand on one device; its losses."""
    return [record["loss"] for record in plain_records(overrides)]


def plain_records(overrides: list[str]) -> list[dict]:
    """The same training, written out by hand on one device: per logged step its loss, tokens/s
    and step time since the last log, as parallel3d's metrics.jsonl has them. A reduced-precision
    ``train.param_dtype`` trains as parallel3d does in every layout (docs/parallelism.md,
    Precision): float32 master weights, a working copy in that dtype that computes forward and
    backward, its gradients accumulated in float32 on the masters; ``model.compile``
    compiles the model and the loss as one graph, as nanoGPT's ``torch.compile(model)`` does
    (its forward returns the loss)."""
    c = OmegaConf.to_object(compose([*overrides, "run_dir=unused"]))
    t = c.train
    device = torch.device("cuda" if torch.cuda.is_available() and t.device != "cpu" else "cpu")
    torch.manual_seed(t.seed)
    with torch.device("meta"):
        model = Transformer(c.model)
    model.to_empty(device=device)
    model.init_weights(t.seed)
    compute = working_copy(model, DTYPES[t.param_dtype])
    # Norms and biases without weight decay, as nanoGPT does and as optim.no_decay says.
    optimizer = torch.optim.AdamW(decay_groups(model, c.optim.weight_decay, c.optim.no_decay), lr=c.optim.lr,
                                  betas=(c.optim.beta1, c.optim.beta2), eps=c.optim.eps, fused=True)  # as ours
    scheduler = build_lr_scheduler(optimizer, c.optim, t.steps)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sampler = StepSampler(open_corpus(c.data).tokens, BatchSpec(t.global_batch_size, t.micro_batch_size, t.seq_len),
                          t.seed)
    tokens = t.global_batch_size * t.seq_len

    def loss_of(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(compute(inputs).flatten(0, 1).float(), targets.flatten(), reduction="sum") / tokens

    loss_of = torch.compile(loss_of) if c.model.compile else loss_of
    records, since, steps_since = [], time.perf_counter(), 0
    for step in range(1, t.steps + 1):
        total = torch.zeros((), device=device)
        copy_masters(model, compute)
        for inputs, targets in sampler.micro_batches(step):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            loss = loss_of(inputs, targets)
            loss.backward()
            accumulate_gradients(compute, model)
            total += loss.detach()
        # As parallel3d clips (optim.total_norm): per-tensor norms in the optimizer's parameter order,
        # summed in float64. Another order or precision rounds the clip factor differently by an ulp,
        # which training amplifies (bit-identical for ~20 steps, 1e-2 apart by step 100).
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params], 2.0,
                                                                         dtype=torch.float64)))
        torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, norm, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        steps_since += 1
        if step % c.logging.log_every == 0 or step == t.steps:
            loss_value = total.item()  # the one host sync, when logging, as in parallel3d
            elapsed = time.perf_counter() - since
            records.append({"step": step, "loss": loss_value, "tokens_per_sec": tokens * steps_since / elapsed,
                            "step_time_s": elapsed / steps_since})
            since, steps_since = time.perf_counter(), 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    return records


def working_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model itself in float32; else a copy whose parameters (not buffers: the RoPE tables
    stay float32, as FSDP's cast leaves them) are in ``dtype``."""
    if dtype == torch.float32:
        return model
    compute = copy.deepcopy(model)
    for p in compute.parameters():
        p.data = p.data.to(dtype)
    return compute


@torch.no_grad()
def copy_masters(model: torch.nn.Module, compute: torch.nn.Module) -> None:
    """The working copy takes the float32 masters' values, rounded to its dtype."""
    if compute is not model:
        torch._foreach_copy_(list(compute.parameters()), list(model.parameters()))


@torch.no_grad()
def accumulate_gradients(compute: torch.nn.Module, model: torch.nn.Module) -> None:
    """A micro batch's gradients, cast to float32, added to the masters' (FSDP's reduce dtype)."""
    if compute is model:
        return
    for w, master in zip(compute.parameters(), model.parameters()):
        if master.grad is None:
            master.grad = w.grad.float()
        else:
            master.grad += w.grad.float()
        w.grad = None


LOOPS = {"parallel3d": ours, "plain": plain}


def timed(loop, overrides: list[str], run_dir: Path) -> tuple[float, float, list[float]]:
    """(CPU seconds, wall seconds, losses) of one whole run."""
    cpu, wall = time.process_time(), time.perf_counter()
    losses = loop(overrides, run_dir)
    return time.process_time() - cpu, time.perf_counter() - wall, losses


def per_step(loop, overrides: list[str], steps: int, run_dir: Path) -> tuple[float, float, list[float]]:
    """(CPU, wall) seconds per step, set-up cancelled: a run of 2n steps less a run of n; its losses."""
    cpu_n, wall_n, _ = timed(loop, [*overrides, f"train.steps={steps}"], run_dir / "n")
    cpu_2n, wall_2n, losses = timed(loop, [*overrides, f"train.steps={2 * steps}"], run_dir / "2n")
    return (cpu_2n - cpu_n) / steps, (wall_2n - wall_n) / steps, losses


def instructions(loop: str, overrides: list[str], steps: int, run_dir: Path) -> tuple[int, list[float]]:
    """Instructions one process executes training ``steps`` steps with ``loop`` (callgrind), and its losses."""
    out = run_dir / f"{loop}-{steps}.callgrind"
    run_dir.mkdir(parents=True, exist_ok=True)
    command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
               "--one", loop, "--run-dir", str(run_dir / f"{loop}-{steps}"), *overrides, f"train.steps={steps}"]
    # One BLAS thread: numpy's OpenBLAS otherwise keeps a worker that spins for a stretch of wall
    # time after start-up, millions of instructions that depend on timing, not on the loop
    # (BENCHMARKS.md gives the spread).
    quiet = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **quiet})
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    totals = next(line for line in out.read_text().splitlines() if line.startswith(("summary:", "totals:")))
    return int(totals.split()[1]), json.loads(proc.stdout.strip().splitlines()[-1])


def count(args, overrides: list[str], argv: list[str] | None) -> int:
    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (apt-get install valgrind)")
        return 2
    per_step, losses = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep) if args.keep else Path(tmp)  # --keep: the profiles, for callgrind_annotate
        for name in LOOPS:
            first, _ = instructions(name, overrides, args.steps, out)
            both, losses[name] = instructions(name, overrides, 2 * args.steps, out)
            per_step[name] = (both - first) / args.steps
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["parallel3d"], losses["plain"]))
    if len(losses["parallel3d"]) != len(losses["plain"]) or worst > 1e-5:
        print(f"the loops trained differently (relative loss difference {worst:.1e}): no comparison")
        return 1
    print(heading("Framework overhead, one rank, in instructions", "bench_overhead.py", argv,
                  f"{args.threads} torch thread(s), valgrind --tool=callgrind"))
    print(f"Losses of the two loops agree to {worst:.1e} (relative).\n")
    print("| loop | instructions per step |\n|---|---|")
    for name, n in per_step.items():
        print(f"| {name} | {n:,.0f} |")
    extra = per_step["parallel3d"] - per_step["plain"]
    print(f"\nOverhead: {extra:+,.0f} instructions per step, {(per_step['parallel3d'] / per_step['plain'] - 1) * 100:+.2f}% "
          "(target: at most +1%)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="measurements of each loop (alternating)")
    parser.add_argument("--steps", type=int, default=20, help="n: runs of n and 2n steps are differenced")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: CPU time is stable)")
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    parser.add_argument("--keep", help="with --instructions: keep the callgrind profiles (<loop>-<steps>.callgrind) here")
    parser.add_argument("--one", choices=list(LOOPS), help=argparse.SUPPRESS)  # a single run, for --instructions
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. logging.log_every=10")
    args = parser.parse_args(argv)
    overrides = ["logging.log_every=1", "optim.warmup_steps=2", *args.overrides]
    with torch_threads(args.threads):
        if args.one:
            print(json.dumps(LOOPS[args.one](args.overrides, Path(args.run_dir))))
            return 0
        if args.instructions:
            return count(args, overrides, argv)
        return compare(args, overrides, argv)


def compare(args, overrides: list[str], argv: list[str] | None) -> int:

    cpu: dict[str, list[float]] = {name: [] for name in LOOPS}
    wall: dict[str, list[float]] = {name: [] for name in LOOPS}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = list(LOOPS) if repeat % 2 == 0 else list(LOOPS)[::-1]
            losses = {}
            for name in order:
                c, w, losses[name] = per_step(LOOPS[name], overrides, args.steps, Path(tmp) / f"{name}{repeat}")
                cpu[name].append(c)
                wall[name].append(w)
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses["parallel3d"], losses["plain"]))
            if len(losses["parallel3d"]) != len(losses["plain"]) or worst > 1e-5:
                print(f"the loops trained differently (relative loss difference {worst:.1e}): no comparison")
                return 1

    median = {kind: {name: statistics.median(v) for name, v in values.items()}
              for kind, values in (("cpu", cpu), ("wall", wall))}
    overhead = {kind: m["parallel3d"] / m["plain"] - 1 for kind, m in median.items()}
    print(heading("Framework overhead, one rank", "bench_overhead.py", argv, f"{args.threads} torch thread(s)"))
    print(f"Losses of the two loops agree to {worst:.1e} (relative).\n")
    print("| loop | CPU ms per step, each repeat | median | wall ms per step, each repeat | median |")
    print("|---|---|---|---|---|")
    for name in LOOPS:
        print(f"| {name} | {', '.join(f'{v * 1e3:.2f}' for v in cpu[name])} | {median['cpu'][name] * 1e3:.2f} "
              f"| {', '.join(f'{v * 1e3:.2f}' for v in wall[name])} | {median['wall'][name] * 1e3:.2f} |")
    # Repeats alternate the loops' order, so each repeat's difference pairs runs made close in time.
    fixed = [(ours - plain) * 1e6 for ours, plain in zip(cpu["parallel3d"], cpu["plain"])]
    print(f"\nOverhead: {overhead['cpu'] * 100:+.1f}% CPU time, {overhead['wall'] * 100:+.1f}% wall time "
          "(target: at most +1%)")
    print(f"Fixed cost per step (CPU time, parallel3d - plain, each repeat): {', '.join(f'{v:+.0f}' for v in fixed)} "
          f"us; median {statistics.median(fixed):+.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
