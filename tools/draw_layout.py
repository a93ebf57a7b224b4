#!/usr/bin/env python
"""Draw a layout: which rank holds which (pp, dp, tp) coordinate, and when each pipeline rank runs
which microbatch under a schedule.

    python tools/draw_layout.py --dp 2 --tp 2 --pp 2 --schedule 1F1B --microbatches 4 --output layout.png

The schedule panel shows torch's own action order for each rank (from
``torch.distributed.pipelining``), placed in time by the dependencies between stages: a stage's
forward waits for the previous stage's, its backward for the next stage's. Forward, backward and
(zero-bubble schedules) input-gradient / weight-gradient actions take 1, 2, 1 and 1 time units.
"""

from __future__ import annotations

import argparse
import sys

from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from parallel3d.parallel.pipeline import is_single_stage, stages_per_rank

DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}
COLOR = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def rank_grid(pp: int, dp: int, tp: int) -> dict[int, tuple[int, int, int]]:
    """rank -> (pp, dp, tp) coordinates for the mesh order (pp, dp, tp), tp innermost."""
    return {((p * dp) + d) * tp + t: (p, d, t) for p in range(pp) for d in range(dp) for t in range(tp)}


def schedule_actions(schedule: str, pp: int, microbatches: int, per_rank: int) -> list[list[tuple[str, int, int]]]:
    """For each pp rank, its actions in order as (kind F/B/I/W, stage, microbatch)."""
    ops = get_schedule_ops(schedule, pp, microbatches, num_stages_per_rank=per_rank)
    out = []
    for rank_ops in ops:
        actions = []
        for op in rank_ops:
            if op is None:
                continue
            for sub in (op.sub_actions or [op]):  # DualPipeV overlaps a forward with a backward
                kind = sub.computation_type.value
                if kind in DURATION:
                    actions.append((kind, sub.stage_index, sub.microbatch_index))
        if is_single_stage(schedule):
            # One stage per rank runs its forwards, and its backwards, in microbatch order; torch
            # 2.13's 1F1B metadata shifts the forward labels of later ranks, so number them here.
            seen = {"F": 0, "B": 0}
            actions = [(kind, stage, _next(seen, kind)) for kind, stage, _ in actions]
        out.append(actions)
    return out


def _next(counter: dict, kind: str) -> int:
    counter[kind] += 1
    return counter[kind] - 1


def timeline(actions: list[list[tuple[str, int, int]]], num_stages: int) -> list[list[tuple[str, int, int, int]]]:
    """Place each rank's actions in time: (kind, stage, microbatch, start)."""
    done: dict[tuple[str, int, int], int] = {}
    placed: list[list] = [[] for _ in actions]
    cursor, free = [0] * len(actions), [0] * len(actions)
    while any(c < len(a) for c, a in zip(cursor, actions)):
        progressed = False
        for r, rank_actions in enumerate(actions):
            while cursor[r] < len(rank_actions):
                kind, stage, mb = rank_actions[cursor[r]]
                if kind == "F":
                    needs = [("F", stage - 1, mb)] if stage > 0 else []
                elif kind in ("B", "I"):
                    needs = [("B", stage + 1, mb)] if stage < num_stages - 1 else [("F", stage, mb)]
                else:
                    needs = [("I", stage, mb)]
                if any(n not in done for n in needs):
                    break
                start = max([free[r], *(done[n] for n in needs)])
                free[r] = start + DURATION[kind]
                done[(kind, stage, mb)] = free[r]
                if kind == "I":
                    done[("B", stage, mb)] = free[r]  # the next stage's backward needs only input grads
                placed[r].append((kind, stage, mb, start))
                cursor[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's actions cannot be ordered (unexpected action order from torch)")
    return placed


def draw(pp: int, dp: int, tp: int, schedule: str, microbatches: int, per_rank: int | None, output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    per_rank = stages_per_rank(schedule, per_rank)
    actions = schedule_actions(schedule, pp, microbatches, per_rank)
    placed = timeline(actions, pp * per_rank)
    span = max(start + DURATION[k] for rank in placed for k, _, _, start in rank)

    mesh_width = pp * (tp + 0.5)
    fig, (mesh_ax, sched_ax) = plt.subplots(1, 2, figsize=(1.3 * mesh_width + 0.45 * span + 2, 1.5 + 1.1 * max(pp, dp)),
                                            gridspec_kw={"width_ratios": [1.3 * mesh_width, 0.45 * span]})
    palette = plt.get_cmap("tab10")
    for rank, (p, d, t) in rank_grid(pp, dp, tp).items():
        x, y = p * (tp + 0.5) + t, d
        mesh_ax.add_patch(Rectangle((x, -y), 0.92, 0.92, color=palette(p), alpha=0.35))
        mesh_ax.text(x + 0.46, -y + 0.46, f"rank {rank}\npp{p} dp{d} tp{t}", ha="center", va="center", fontsize=7)
    mesh_ax.set_xlim(-0.1, mesh_width)
    mesh_ax.set_ylim(-dp + 0.9, 1.0)
    mesh_ax.set_title(f"pp={pp} x dp={dp} x tp={tp}: rank = (pp*dp + dp_rank)*tp + tp_rank", fontsize=9)
    mesh_ax.axis("off")

    for r, rank_actions in enumerate(placed):
        for kind, stage, mb, start in rank_actions:
            sched_ax.add_patch(Rectangle((start, pp - 1 - r), DURATION[kind] - 0.05, 0.9, color=COLOR[kind],
                                         alpha=0.45 + 0.5 * (stage % per_rank == 0 if per_rank > 1 else 1)))
            label = f"{mb}" if per_rank == 1 else f"{mb}\ns{stage}"
            sched_ax.text(start + DURATION[kind] / 2, pp - 1 - r + 0.45, label, ha="center", va="center",
                          fontsize=7)
    sched_ax.set_xlim(0, span)
    sched_ax.set_ylim(0, pp)
    sched_ax.set_yticks([pp - 1 - r + 0.45 for r in range(pp)], [f"pp rank {r}" for r in range(pp)])
    sched_ax.set_xlabel("time (forward = 1 unit)")
    sched_ax.set_title(f"{schedule}: {microbatches} microbatches, {per_rank} stage(s) per rank "
                       f"(cell: microbatch{'' if per_rank == 1 else ', stage'})")
    kinds = sorted({k for rank in placed for k, *_ in rank}, key="FBIW".index)
    names = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
    sched_ax.legend(handles=[Patch(color=COLOR[k], alpha=0.7, label=names[k]) for k in kinds],
                    loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (dp_replicate x dp_shard)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--stages-per-rank", type=int, default=None)
    parser.add_argument("--output", default="layout.png")
    args = parser.parse_args(argv)
    if args.microbatches < args.pp and args.schedule != "GPipe":
        parser.error(f"{args.schedule} needs at least --pp={args.pp} microbatches")
    draw(args.pp, args.dp, args.tp, args.schedule, args.microbatches, args.stages_per_rank, args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
