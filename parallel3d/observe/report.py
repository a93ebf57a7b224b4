"""A one-screen summary of a run, from what it wrote to its run dir.

    parallel3d-report RUN_DIR

Layout, steps, losses, throughput, the slowest ranks, skipped steps, checkpoints and where the
profiler traces are: read from config.yaml, metrics.jsonl, checkpoints/ and profile/. Nothing
is recomputed; a run still training reports what it has written so far.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import yaml

from parallel3d.base import GIB
from parallel3d.observe.metrics import read_metrics


def layout_line(config: dict) -> str:
    p, t, m = config.get("parallel", {}), config.get("train", {}), config.get("model", {})
    degrees = " ".join(f"{k} {p[k]}" for k in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep") if p.get(k, 1) != 1)
    pipeline = f" ({p.get('pp_schedule')})" if p.get("pp", 1) > 1 else ""
    return (f"layout:      {degrees or 'one rank'}{pipeline}, zero_stage {p.get('zero_stage')} | model "
            f"{m.get('name')} | {t.get('param_dtype')} | batch {t.get('global_batch_size')} x seq {t.get('seq_len')}")


def metric_lines(rows: list[dict], planned_steps: int | None) -> list[str]:
    last = rows[-1]
    losses = [r["loss"] for r in rows if not r.get("skipped")]  # a skipped step's loss is the bad one
    losses = losses or [r["loss"] for r in rows]
    planned = f" of {planned_steps}" if planned_steps else ""
    lines = [f"steps:       {last['step']}{planned} logged ({len(rows)} rows)",
             f"loss:        {losses[0]:.4f} at step {rows[0]['step']} -> {losses[-1]:.4f} (lowest {min(losses):.4f})"]
    evals = [r for r in rows if "val_loss" in r]
    if evals:
        lines.append(f"val_loss:    {evals[-1]['val_loss']:.4f} at step {evals[-1]['step']}")
    tokens = statistics.median(r["tokens_per_sec"] for r in rows)
    step = statistics.median(r["step_time_s"] for r in rows)
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    lines.append(f"throughput:  {tokens:,.0f} tok/s, {step:.3f} s/step (medians)"
                 + (f", MFU {statistics.median(mfu) * 100:.1f}%" if mfu else ""))
    peak = max(rows, key=lambda r: r.get("max_memory_bytes", 0))
    if "max_memory_bytes" in peak:
        where = f" on rank {peak['max_memory_rank']}" if "max_memory_rank" in peak else ""
        lines.append(f"memory:      peak {peak['max_memory_bytes'] / GIB:.2f} GiB{where} at step {peak['step']}")
    lines += slowest_lines(rows)
    if "skipped_steps" in last:
        lines.append(f"skipped:     {last['skipped_steps']} bad steps skipped")
    return lines


def slowest_lines(rows: list[dict]) -> list[str]:
    """Which ranks were slowest how often, and by how much (max over min step time, median)."""
    timed = [r for r in rows if "slowest_rank" in r and r.get("step_time_min_s")]
    if not timed:
        return []
    counts = Counter(r["slowest_rank"] for r in timed).most_common(3)
    spread = statistics.median(r["step_time_max_s"] / r["step_time_min_s"] for r in timed)
    ranks = ", ".join(f"rank {rank} ({n}/{len(timed)} rows)" for rank, n in counts)
    lines = [f"slowest:     {ranks}; slowest/fastest rank step time {spread:.2f}x (median)"]
    data = [r for r in rows if "slowest_data_rank" in r]
    if data and max(r["data_wait_max_s"] for r in data) > 0:
        worst = max(data, key=lambda r: r["data_wait_max_s"])
        lines.append(f"data wait:   up to {worst['data_wait_max_s'] * 1e3:.1f} ms/step on rank "
                     f"{worst['slowest_data_rank']} at step {worst['step']}")
    return lines


def file_lines(run_dir: Path) -> list[str]:
    complete = sorted((p for p in (run_dir / "checkpoints").glob("step_*") if (p / "COMPLETE").exists()),
                      key=lambda p: int(p.name.split("_")[1]))
    lines = [f"checkpoints: {', '.join(p.name for p in complete) if complete else 'none'}"
             + (f" (newest {complete[-1]})" if complete else "")]
    traces = sorted((run_dir / "profile").glob("**/*.json")) + sorted((run_dir / "profile").glob("**/*.pickle"))
    if traces:
        windows = sorted({str(p.parent) for p in traces})
        lines.append(f"traces:      {len(traces)} file{'s' if len(traces) > 1 else ''} in {', '.join(windows)} (open .json at https://ui.perfetto.dev, "
                     f".pickle at https://pytorch.org/memory_viz)")
    if (run_dir / "tensorboard").is_dir():
        lines.append(f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}")
    logs = sorted((run_dir / "logs").glob("rank*.log"))
    if logs:
        lines.append(f"logs:        {len(logs)} rank logs in {run_dir / 'logs'}")
    return lines


def report(run_dir: Path) -> list[str]:
    """The summary's lines. Raises FileNotFoundError when ``run_dir`` holds no run."""
    config_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if not config_path.is_file() and not metrics_path.is_file():
        raise FileNotFoundError(f"{run_dir} has no config.yaml or metrics.jsonl: not a run dir")
    config = yaml.safe_load(config_path.read_text()) if config_path.is_file() else {}
    lines = [f"run:         {run_dir} ({config.get('recipe') or 'custom'})"]
    if config:
        lines.append(layout_line(config))
    rows = read_metrics(metrics_path)
    planned = config.get("train", {}).get("steps")
    lines += metric_lines(rows, planned) if rows else ["steps:       none logged yet"]
    return lines + file_lines(run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path)
    args = parser.parse_args(argv)
    try:
        print("\n".join(report(args.run_dir)))
    except (OSError, ValueError) as e:
        print(f"parallel3d-report: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
