#!/usr/bin/env python
"""Plan a layout: per-rank memory, communication, pipeline bubble and step time, before any GPU.

Rank every layout of a model on a cluster (fastest first, the recommended one starred):

    parallel3d-plan model=llama3_8b --gpus 64 --gpus-per-node 8 --gpu-memory 80GiB \\
        --seq-len 8192 --global-batch 1024 [--top 10] [--json plans.json]

Break down one configured layout (a recipe, with any overrides):

    parallel3d-plan recipe=llama3_70b parallel.pp=2 --world-size 64

Positional arguments are Hydra overrides, as for ``python -m parallel3d.train``; the batch,
sequence length and dtypes default to the composed config's. Memory is per rank (the largest),
in GiB; communication is what one rank sends per optimizer step, in GB (ring algorithms).
"""

from __future__ import annotations

import argparse
import json
import sys

from parallel3d.base import GIB, parse_size

GROUPS = (("dp", "dp"), ("dp_shard", "shard"), ("dp_replicate", "repl"), ("tp", "tp"), ("pp", "pp"))


def parse_bytes(text: str) -> int:
    """``80`` (GiB, as GPU memory is quoted), ``80GiB``, ``80GB``, ``85899345920B`` -> bytes."""
    try:
        return parse_size(text, bare_unit=GIB)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def gb(x: float) -> str:
    return f"{x / 1e9:.1f}" if x else "-"


def gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def layout_cells(plan) -> list[str]:
    lay = plan.layout
    dp = f"{lay.dp_replicate}x{lay.dp_shard}" if lay.dp_replicate > 1 else str(lay.dp_shard)
    sched = "" if lay.pp == 1 else lay.pp_schedule + (f"x{lay.stages_per_rank}" if lay.stages_per_rank > 1 else "")
    return [dp, str(lay.tp), str(lay.pp), str(lay.zero_stage), str(lay.micro_batch_size),
            lay.activation_checkpoint, sched or "-"]


def table(plans, marks: list[str]) -> str:
    head = ["", "dp", "tp", "pp", "zero", "mb", "ac", "schedule", "params", "grads", "optim", "act", "peak",
            *(name for _, name in GROUPS), "bubble", "step s", "MFU", "fits"]
    rows = [head]
    for mark, plan in zip(marks, plans):
        comm = [gb(sum(plan.comm_bytes.get(group, {}).values())) for group, _ in GROUPS]
        st = plan.step_time
        rows.append([mark, *layout_cells(plan), gib(plan.param_bytes), gib(plan.grad_bytes),
                     gib(plan.optim_state_bytes), gib(plan.activation_bytes), gib(plan.peak_bytes), *comm,
                     f"{plan.bubble_fraction:.1%}", f"{st.total_s:.2f}" if st else "-",
                     f"{st.mfu:.1%}" if st else "-", {True: "yes", False: "NO", None: "-"}[plan.fits]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) if i > 0 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def breakdown(plan) -> str:
    """One layout in detail: every pipeline rank's memory, each group's collectives, the time."""
    lay, out = plan.layout, []
    out.append(f"layout {lay.name()}  ({lay.world_size} ranks: dp_replicate {lay.dp_replicate} x dp_shard "
               f"{lay.dp_shard} x tp {lay.tp} x pp {lay.pp}; {lay.micro_batches} micro batches of "
               f"{lay.micro_batch_size} x {lay.seq_len} tokens per rank and step)")
    out.append("\nmemory per rank, GiB (pipeline rank: its data-parallel rank 0, which holds the most)")
    rows = [["pp rank", "stages", "params", "grads", "optim", "activations", "transient", "peak"]]
    for r in plan.ranks:
        rows.append([str(r.pp_rank), ",".join(map(str, r.stages)), gib(r.param_bytes), gib(r.grad_bytes),
                     gib(r.optim_state_bytes), gib(r.activation_bytes), gib(r.transient_bytes), gib(r.peak_bytes)])
    out.append(_grid(rows))
    out.append("\ncommunication per optimizer step, GB sent by the busiest rank (ring algorithms)")
    rows = [["group", "collective", "GB"]]
    for group, kinds in plan.comm_bytes.items():
        rows += [[group, kind, f"{sent / 1e9:.3f}"] for kind, sent in kinds.items()]
    out.append(_grid(rows) if len(rows) > 1 else "  none")
    out.append(f"\npipeline bubble {plan.bubble_fraction:.1%}")
    if plan.step_time:
        st = plan.step_time
        comm = ", ".join(f"{g} {s:.2f}s" for g, s in st.comm_s.items()) or "none"
        out.append(f"step time {st.total_s:.2f}s = compute {st.compute_s:.2f}s + bubble {st.bubble_s:.2f}s + exposed "
                   f"communication {st.exposed_comm_s:.2f}s (all traffic: {comm}); MFU {st.mfu:.1%}, "
                   f"{st.tokens_per_s:,.0f} tokens/s")
        out.append(f"fits: {'yes' if plan.fits else 'NO'} (peak {gib(plan.peak_bytes)} GiB)")
    return "\n".join(out)


def _grid(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=..., recipe=..., parallel.tp=...")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--gpus", type=int, help="rank every layout on this many GPUs")
    mode.add_argument("--world-size", type=int, help="break down the configured layout on this many ranks")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory", type=parse_bytes, default=80 * GIB, help="per GPU: 80 (GiB), 80GiB (default), 80GB")
    parser.add_argument("--intra-node-bw", type=float, default=450, help="GB/s one GPU sends in a node (450)")
    parser.add_argument("--inter-node-bw", type=float, default=50, help="GB/s one GPU sends across nodes (50)")
    parser.add_argument("--peak-tflops", type=float, default=989, help="dense TFLOP/s per GPU (989: H100 bf16)")
    parser.add_argument("--efficiency", type=float, default=0.5, help="share of peak matmuls reach (0.5)")
    parser.add_argument("--seq-len", type=int, help="default: the config's train.seq_len")
    parser.add_argument("--global-batch", type=int, help="sequences per step; default: the config's")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranking to print (default 10)")
    parser.add_argument("--json", help="write the plans (ranking, or the one layout) to this file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)

    from parallel3d.base import ConfigError
    from parallel3d.config.compose import compose
    from parallel3d.planner import Hardware, predict, rank_layouts

    overrides = list(args.overrides)
    if args.seq_len:
        overrides.append(f"train.seq_len={args.seq_len}")
    if args.global_batch:
        overrides.append(f"train.global_batch_size={args.global_batch}")
    try:
        cfg = compose(overrides)
    except Exception as e:  # Hydra's and OmegaConf's errors, a broken recipe: one line
        print(f"plan_layout: config error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    hw = Hardware(args.gpu_memory, args.gpus_per_node, args.intra_node_bw * 1e9, args.inter_node_bw * 1e9,
                  args.peak_tflops * 1e12, args.efficiency)
    if args.world_size:
        try:
            plan = predict(cfg, args.world_size, hw)
        except ConfigError as e:
            print(f"plan_layout: config error: {e}", file=sys.stderr)
            return 2
        print(breakdown(plan))
        print("\n" + table([plan], [""]))
        _write_json(args.json, {"plan": plan.to_dict()})
        return 0

    candidates = rank_layouts(cfg, args.gpus, hardware=hw)
    print(f"{cfg.model.name} on {args.gpus} GPUs ({args.gpus_per_node} per node, {gib(args.gpu_memory)} GiB), "
          f"seq {cfg.train.seq_len}, global batch {cfg.train.global_batch_size} sequences, "
          f"{cfg.train.param_dtype} compute: {len(candidates)} layouts fit")
    if not candidates:
        print("nothing fits: more GPUs, a smaller global batch or sequence, or more memory per GPU")
        return 1
    best = next(c for c in candidates if c.recommended)
    shown = candidates[: args.top] + ([best] if best not in candidates[: args.top] else [])
    print(table([c.plan for c in shown], ["*" if c.recommended else str(candidates.index(c) + 1) for c in shown]))
    print(f"\n* recommended (simplest within 3% of the fastest): {' '.join(best.overrides)}")
    _write_json(args.json, {"recommended": candidates.index(best), "candidates": [
        {**c.plan.to_dict(), "overrides": c.overrides, "recommended": c.recommended} for c in candidates]})
    return 0


def _write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
