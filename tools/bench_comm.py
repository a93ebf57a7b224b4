#!/usr/bin/env python
"""Communication per layout: every collective a training step runs, measured by the dry run
(parallel3d/planner/dryrun.py: the real program on fake tensors and torch's fake process group), next to
what the planner predicts. Prints a Markdown table for BENCHMARKS.md.

    python tools/bench_comm.py                      # the tiny model in the standard layouts
    python tools/bench_comm.py --large              # and the 405B recipe's first rank (~1 min)

Bytes are per rank per optimizer step. ``payload``: all-gather its output, reduce-scatter its
input, all-reduce / send the tensor. ``sent``: what the rank puts on the wire under ring
algorithms ((n-1)/n of the payload for all-gather and reduce-scatter, 2(n-1)/n for all-reduce, all
of it for send). Collectives of fewer than ``SCALAR_BYTES`` per call (the gradient norm's one float
per tensor, its square over pp) are marked: the planner leaves them out.
The minimum each layout can move, and why any collective exceeds it, is stated next to the closed
forms in tests/test_dryrun.py, which asserts every row byte for byte.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from bench_common import print_dry_run_table  # noqa: E402

from parallel3d.config.compose import compose
from parallel3d.planner import predict  # noqa: E402
from parallel3d.planner.dryrun import dry_run  # noqa: E402

SCALAR_BYTES = 1024
# name: (world size, overrides, the ranks to run)
LAYOUTS = {
    "ddp": (4, ["parallel=ddp"], [0]),
    "zero1": (4, ["parallel=zero1"], [0]),
    "zero2": (4, ["parallel=zero2"], [0]),
    "zero3": (4, ["parallel=fsdp"], [0]),
    "hsdp 2x2": (4, ["parallel=hsdp"], [0]),
    "tp2 sp": (2, ["parallel.tp=2", "train.global_batch_size=4"], [0]),
    "tp2 sp ac=full": (2, ["parallel.tp=2", "train.global_batch_size=4", "model.activation_checkpoint=full"], [0]),
    "tp2 sp ac=op": (2, ["parallel.tp=2", "train.global_batch_size=4", "model.activation_checkpoint=op"], [0]),
    "tp2 no sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=false", "train.global_batch_size=4"], [0]),
    "pp2 1F1B": (2, ["parallel.pp=2", "train.global_batch_size=4"], [0]),
    "dp2 tp2 pp2 zero3 (3D)": (8, ["recipe=tiny_cpu_3d", "train.global_batch_size=8"], [0, 4]),
}
LARGE = {"405B tp8 pp8 dp8 zero3": (512, ["recipe=llama3_405b"], [0])}


def planned(overrides: list[str], world: int, pp_rank: int) -> dict[tuple[str, str], float]:
    """The planner's bytes sent by (mesh dim, kind), in the dry run's names, for one pp rank."""
    from parallel3d.planner.comm import stage_traffic
    from parallel3d.planner.layout import rank_stages

    plan = predict(compose([*overrides, "run_dir=."]), world)
    traffic = stage_traffic(plan.model, rank_stages(plan.layout, plan.model.n_layers, pp_rank), plan.layout)
    # The planner names DDP/ZeRO-1's group "dp" (all data-parallel ranks); the mesh calls a lone
    # data-parallel dim dp_shard.
    lone = plan.layout.dp_replicate == 1
    return {("dp_shard" if group == "dp" and lone else group, "send" if kind == "send_recv" else kind): sent
            for group, kinds in traffic.items() for kind, sent in kinds.items()}


def table(layouts: dict) -> list[str]:
    rows = ["| layout | rank | dim | kind | calls | payload B | sent B | planner sent B |",
            "|---|---|---|---|---|---|---|---|"]
    for name, (world, overrides, ranks) in layouts.items():
        for report in dry_run(overrides, world, ranks):
            plan = planned(overrides, world, report.coords.get("pp", 0))
            for dim, kinds in sorted(report.comm.items()):
                for kind, s in sorted(kinds.items()):
                    if kind == "recv":
                        continue  # the other end of a send
                    scalar = s.bytes / max(s.calls, 1) < SCALAR_BYTES
                    predicted = "(scalars)" if scalar else f"{plan.get((dim, kind), 0):,.0f}"
                    rows.append(f"| {name} | {report.rank} | {dim} | {kind} | {s.calls} | {s.bytes:,} | "
                                f"{s.sent_bytes:,.0f} | {predicted} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--large", action="store_true", help="also the 405B recipe's rank 0")
    args = parser.parse_args(argv)
    layouts = LAYOUTS | (LARGE if args.large else {})
    return print_dry_run_table("Communication per rank per step, measured and planned", "bench_comm.py", argv,
                               lambda: table(layouts))


if __name__ == "__main__":
    sys.exit(main())
