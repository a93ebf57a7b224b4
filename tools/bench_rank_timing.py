#!/usr/bin/env python
"""What per-rank timing costs a logging step: the meter's one collective of every rank's figures
(and what it computes from them) against the all_reduce of the memory maxima it replaced, and
against an all_reduce of a table of the same figures.

    torchrun --standalone --nproc-per-node 4 tools/bench_rank_timing.py [--calls 2000] [--repeats 5]

Each repeat times ``--calls`` logging-step collectives of each kind, each kind first in turn;
medians over repeats, in microseconds per logging step as rank 0 saw them: wall time, and the
CPU time of rank 0's process (what load on a shared machine moves least). Also timed: what the
meter computes from the figures, and the two clock reads per step that measure a rank's busy
time. Prints a Markdown block for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import heading  # noqa: E402

from parallel3d.observe.meter import gather_per_rank, spread  # noqa: E402
from parallel3d.runtime.straggler import StragglerWatch  # noqa: E402


def before(values: list[float]) -> None:
    """The read before issue 26: the largest rank's memory figures, one all_reduce(MAX)."""
    t = torch.tensor(values[:4], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    t.tolist()


def gathered(values: list[float]) -> list[list[float]]:
    """The read now: every rank's six figures, one all_gather (parallel3d/observe/meter.py)."""
    return gather_per_rank(values, torch.device("cpu"))


def table(values: list[float]) -> None:
    """The same figures by an all_reduce(SUM) of a table with a row per rank (an alternative, not used)."""
    rows = torch.zeros(dist.get_world_size(), len(values), dtype=torch.float64)
    rows[dist.get_rank()] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(rows)
    rows.tolist()


def digest(ranks: list[list[float]], watch: StragglerWatch) -> None:
    """What the meter computes from the table: maxima, spreads, the straggler check (no collective)."""
    columns = list(zip(*ranks))
    [int(max(c)) for c in columns[:4]]
    spread(list(columns[4]), "step_time", "slowest_rank"), spread(list(columns[5]), "data_wait", "slowest_data_rank")
    watch.check(1, list(columns[4]))


def per_call_us(fn, calls: int) -> tuple[float, float]:
    """(wall, CPU time of this process) per call, in microseconds."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6, (time.process_time() - cpu) / calls * 1e6


def clock_us(calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        time.thread_time(), time.thread_time()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    values = [3e9, 1e8, 1e8, 2e8, 0.05 + dist.get_rank() * 1e-3, 1e-4]
    watch = StragglerWatch(factor=2.0, steps=3, hosts=["h"] * dist.get_world_size())
    kinds = {"before": lambda: before(values), "now": lambda: gathered(values), "table": lambda: table(values)}
    timings = {kind: [] for kind in kinds}
    for repeat in range(args.repeats):
        for kind in list(kinds)[repeat % 3:] + list(kinds)[:repeat % 3]:  # each kind first in turn
            timings[kind].append(per_call_us(kinds[kind], args.calls))
    ranks = gathered(values)
    digests = statistics.median(per_call_us(lambda: digest(ranks, watch), args.calls)[1] for _ in range(args.repeats))
    clocks = statistics.median(clock_us(args.calls * 10) for _ in range(args.repeats))
    if dist.get_rank() == 0:
        (old, old_cpu), (new, new_cpu), (gather, gather_cpu) = (
            [statistics.median(t[i] for t in timings[k]) for i in (0, 1)] for k in ("before", "now", "table"))
        print(heading("Per-rank timing: the logging step's collective", "bench_rank_timing.py",
                      sys.argv[1:], f"{dist.get_world_size()} gloo ranks (torchrun)") + "\n")
        print("| per logging step, rank 0 | wall time | CPU time |\n|---|---|---|")
        print(f"| all_reduce(MAX) of 4 memory figures (before) | {old:.1f} us | {old_cpu:.1f} us |")
        print(f"| all_gather of 6 figures per rank (now) | {new:.1f} us | {new_cpu:.1f} us |")
        print(f"| difference | {new - old:+.1f} us | {new_cpu - old_cpu:+.1f} us |")
        print(f"| (all_reduce(SUM) of a table of the same figures, not used) | {gather:.1f} us | {gather_cpu:.1f} us |")
        print(f"| maxima, spreads and the straggler check from the table (no collective) | | {digests:.1f} us |")
        print(f"| two busy-clock reads per step (`time.thread_time`) | {clocks:.2f} us | |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
