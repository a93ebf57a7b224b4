#!/usr/bin/env python
"""Dry-run a layout on this CPU: the real program for chosen ranks, on fake tensors and torch's fake
process group, reporting each rank's memory and the bytes its collectives move in one step.

    parallel3d-dry-run --world-size 512 recipe=llama3_405b              # tp 8 x pp 8 x dp 8
    parallel3d-dry-run --world-size 512 recipe=llama3_405b parallel.pp_schedule=1F1B \\
        parallel.pp_stages_per_rank=null train.global_batch_size=128 --ranks 0,448 --json out.json

Ranks default to the first of each pipeline stage. Memory is tensor memory (params, grads,
optimizer state, activations, temporaries) as torch's MemTracker follows it; a GPU adds its CUDA
context, NCCL buffers and allocator fragmentation on top. See parallel3d/planner/dryrun.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from parallel3d.base import ConfigError
from parallel3d.planner.dryrun import RankReport, dry_run

UNITS = {"GiB": 2**30, "MiB": 2**20}
# MemTracker's categories at the peak, in the order printed.
PEAK_PARTS = (("Parameter", "params"), ("Gradient", "grads"), ("Optstate", "optim"), ("Activation", "activ"),
              ("Temp", "temp"), ("Buffer", "buffers"), ("Other", "other"))


def memory_table(reports: list[RankReport], unit: str) -> str:
    u = UNITS[unit]
    head = (f"{'rank':>5} {'coords':<28} {'stages':<8} {'params':>8} {'grads':>8} {'optim':>8} {'peak':>8} | "
            + " ".join(f"{short:>8}" for _, short in PEAK_PARTS) + f" {'time s':>7}")
    lines = [f"memory per rank, {unit} (params/grads/optim: local shards after the step; peak: all tensors at "
             "the step's peak, then what it held by kind)", head]
    for r in reports:
        coords = " ".join(f"{k}{v}" for k, v in r.coords.items())
        stages = ",".join(map(str, r.stages))
        lines.append(f"{r.rank:>5} {coords:<28} {stages:<8} {r.param_bytes / u:>8.2f} {r.grad_bytes / u:>8.2f} "
                     f"{r.optim_state_bytes / u:>8.2f} {r.peak_bytes / u:>8.2f} | "
                     + " ".join(f"{r.peak_breakdown.get(key, 0) / u:>8.2f}" for key, _ in PEAK_PARTS)
                     + f" {r.seconds:>7.1f}")
    return "\n".join(lines)


def comm_table(reports: list[RankReport], unit: str) -> str:
    u = UNITS[unit]
    lines = [f"communication per rank per step, {unit} (payload: all-gather output, reduce-scatter input, "
             "all-reduce/send/recv the tensor; sent: this rank's bytes on the wire, ring algorithms)",
             f"{'rank':>5} {'dim':<12} {'kind':<15} {'calls':>7} {'payload':>11} {'sent':>11}"]
    for r in reports:
        for dim, kinds in sorted(r.comm.items()):
            for kind, s in sorted(kinds.items()):
                lines.append(f"{r.rank:>5} {dim:<12} {kind:<15} {s.calls:>7} {s.bytes / u:>11.4f} "
                             f"{s.sent_bytes / u:>11.4f}")
    return "\n".join(lines)


def _progress_line():
    """Prints each step of the dry run to stderr with the time since the start: rank by rank."""
    start = time.perf_counter()
    return lambda line: print(f"{line} [{time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="config overrides, as for python -m parallel3d.train")
    parser.add_argument("--world-size", type=int, required=True, help="ranks of the layout (e.g. 512)")
    parser.add_argument("--ranks", default=None, help="comma-separated ranks; default: the first of each pp stage")
    parser.add_argument("--json", default=None, help="also write the reports to this file")
    args = parser.parse_intermixed_args(argv)
    # DTensor warns, once per rank, that the grad norm over (dp_shard, tp) runs two all-reduces
    # where one over a flattened mesh would do: bytes the tables show, noise between them.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    try:
        reports = dry_run(args.overrides, args.world_size, ranks, announce=_progress_line())
    except (ConfigError, ValueError) as e:  # a layout that cannot run; ranks outside the world
        print(f"dry_run: {'config error: ' if isinstance(e, ConfigError) else ''}{e}", file=sys.stderr)
        return 2
    print(f"dry run: {args.world_size} ranks | {' '.join(args.overrides)}")
    unit = "GiB" if max(r.peak_bytes for r in reports) >= 2**30 else "MiB"  # small models read in MiB
    print(memory_table(reports, unit))
    print()
    print(comm_table(reports, unit))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in reports], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
