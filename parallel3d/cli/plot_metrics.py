#!/usr/bin/env python
"""Plot the metrics.jsonl of one or more runs, overlaid, as PNGs: compare runs without wandb.

    parallel3d-plot outputs/2025-06-01/12-00-00 /tmp/run_b/metrics.jsonl --out plots --smooth 10

Writes one PNG per metric (``loss.png``, ``tokens_per_sec.png``, ...) with each run as a line over
the step, and ``summary.png`` with all of them in a grid. A run keeps its color in every plot and
its legend label is its run dir's name (``--labels`` to choose). Memory is in GiB, MFU in percent;
null values (MFU on CPU) are left out, and a metric no run logged is skipped with a note.
``--smooth N`` draws the trailing mean of the last N logged rows in front of the faint raw line
(noisy metrics only: loss, grad norm, throughput, MFU). ``step_time_ranks`` draws, per run, the
slowest rank's step time (solid) and the fastest's (dashed) with the band between them shaded:
a wide band is a rank that holds the others back (docs/observability.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window: this runs on headless training machines
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from parallel3d.base import GIB  # noqa: E402
from parallel3d.observe.metrics import read_metrics  # noqa: E402

RANK_SPREAD = "step_time_ranks"  # step_time_max_s and step_time_min_s in one plot
DEFAULT_METRICS = ("loss", "val_loss", "grad_norm", "lr", "tokens_per_sec", RANK_SPREAD, "mfu", "max_memory_bytes")
# metric -> (axis label, factor from the logged value to the plotted one)
UNITS = {
    "loss": ("loss", 1),
    "val_loss": ("validation loss", 1),
    "grad_norm": ("grad norm (before clipping)", 1),
    "lr": ("learning rate", 1),
    "tokens_per_sec": ("tokens / s (all ranks)", 1),
    "step_time_s": ("step time (s)", 1),
    RANK_SPREAD: ("step time per rank: slowest, fastest (s)", 1),
    "step_time_max_s": ("step time, slowest rank (s)", 1),
    "step_time_min_s": ("step time, fastest rank (s)", 1),
    "data_wait_max_s": ("data wait, slowest rank (s)", 1),
    "mfu": ("MFU (%)", 100),
    "max_memory_bytes": ("peak memory, largest rank (GiB)", 1 / GIB),
    "param_bytes": ("parameters, largest rank (GiB)", 1 / GIB),
    "grad_bytes": ("gradients, largest rank (GiB)", 1 / GIB),
    "optim_state_bytes": ("optimizer state, largest rank (GiB)", 1 / GIB),
}
# --smooth applies to these only: lr and the memory peaks are exact, averaging would just blur them
NOISY = {"loss", "grad_norm", "tokens_per_sec", "step_time_s", "mfu", RANK_SPREAD, "step_time_max_s",
         "step_time_min_s", "data_wait_max_s"}


def metrics_file(run: str | Path) -> Path:
    """The metrics.jsonl of a run dir, or the path itself when it names a file."""
    path = Path(run)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl at {run}")
    return path


def load_metrics(run: str | Path) -> list[dict]:
    """One run's rows sorted by step; a step logged twice keeps its last row."""
    return read_metrics(metrics_file(run))


def run_labels(runs: list[str | Path]) -> list[str]:
    """Each run dir's name, with as many parent dirs as it takes to tell the runs apart."""
    keys = []
    for run in runs:
        path = metrics_file(run).resolve()
        keys.append(path.parent if path.name == "metrics.jsonl" else path.with_suffix(""))
    for depth in range(1, max(len(k.parts) for k in keys) + 1):
        labels = ["/".join(k.parts[-depth:]) for k in keys]
        if len(set(labels)) == len(labels):
            return labels
    return [f"{k.name} #{i}" for i, k in enumerate(keys)]  # the same run given twice


def series(rows: list[dict], metric: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values in plotted units) of the rows that logged a number for the metric."""
    if metric == RANK_SPREAD:  # present where the slowest rank's time is
        metric = "step_time_max_s"
    factor = UNITS.get(metric, (metric, 1))[1]
    kept = [(row["step"], row[metric]) for row in rows if isinstance(row.get(metric), (int, float))]
    steps, values = zip(*kept) if kept else ((), ())
    return np.array(steps, dtype=float), np.array(values, dtype=float) * factor


def trailing_mean(values: np.ndarray, n: int) -> np.ndarray:
    """Trailing mean over the last n points; fewer at the start, so the line starts where the run does."""
    if n <= 1 or not len(values):
        return values
    total = np.concatenate([[0.0], np.cumsum(values)])
    end = np.arange(1, len(values) + 1)
    start = np.maximum(end - n, 0)
    return (total[end] - total[start]) / (end - start)


def draw_metric(ax, data: dict[str, list[dict]], metric: str, n: int = 1) -> None:
    n = n if metric in NOISY else 1
    for i, (label, rows) in enumerate(data.items()):
        if metric == RANK_SPREAD:
            draw_rank_spread(ax, rows, label, f"C{i}", n)
            continue
        steps, values = series(rows, metric)
        if not len(steps):
            continue
        color = f"C{i}"  # by run, not by line drawn: a run missing a metric must not recolor the others
        if n > 1:  # the raw line stays, faint and out of the legend (a leading "_" label), to show the noise
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1, label=f"_{label} raw")
        ax.plot(steps, trailing_mean(values, n), color=color, label=label, marker="o" if len(steps) == 1 else None)
    title, factor = UNITS.get(metric, (metric, 1))
    ax.set_title(title + (f", mean of {n} rows" if n > 1 else ""), fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if factor == 1 / GIB:
        ax.set_ylim(bottom=0)  # memory is read against the device's capacity, so keep zero in view
    ax.grid(alpha=0.3)


def draw_rank_spread(ax, rows: list[dict], label: str, color: str, n: int) -> None:
    """One run's slowest and fastest rank's step time, the band between them shaded."""
    steps, slowest = series(rows, "step_time_max_s")
    _, fastest = series(rows, "step_time_min_s")
    if not len(steps) or len(fastest) != len(slowest):
        return
    slowest, fastest = trailing_mean(slowest, n), trailing_mean(fastest, n)
    ax.plot(steps, slowest, color=color, label=label, marker="o" if len(steps) == 1 else None)
    ax.plot(steps, fastest, color=color, linestyle="--", label=f"_{label} fastest rank")
    ax.fill_between(steps, fastest, slowest, color=color, alpha=0.15)


def metric_figure(data: dict[str, list[dict]], metric: str, n: int = 1):
    """One metric, every run overlaid; the caller saves and closes it."""
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    draw_metric(ax, data, metric, n)
    ax.legend(fontsize=8)
    return fig


def summary_figure(data: dict[str, list[dict]], metrics: list[str], n: int = 1):
    """All metrics in a grid with one legend on top."""
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows + 0.5), squeeze=False, layout="constrained")
    for ax, metric in zip(axes.flat, metrics):
        draw_metric(ax, data, metric, n)
    for ax in axes.flat[len(metrics):]:
        ax.axis("off")
    handles = {}
    for ax in axes.flat:
        for line in ax.get_lines():
            if not line.get_label().startswith("_"):
                handles.setdefault(line.get_label(), line)
    fig.legend(handles.values(), handles.keys(), loc="outside upper center", ncol=min(len(handles), 4), fontsize=9)
    return fig


def plot_runs(runs: list[str | Path], out_dir: str | Path, metrics=DEFAULT_METRICS, labels: list[str] | None = None,
              smooth: int = 1) -> list[Path]:
    """Write <metric>.png for each metric some run logged, and summary.png; return the paths written."""
    labels = list(labels) if labels else run_labels(runs)
    if len(labels) != len(runs) or len(set(labels)) != len(labels):
        raise ValueError(f"need one distinct label per run: {len(runs)} runs, labels {labels}")
    data = {label: load_metrics(run) for label, run in zip(labels, runs)}
    present = [metric for metric in metrics if any(len(series(rows, metric)[0]) for rows in data.values())]
    for metric in (m for m in metrics if m not in present):
        print(f"note: skipping {metric}: no run logged a value for it", file=sys.stderr)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in [*present, "summary"] if len(present) > 1 else present:  # one figure open at a time
        fig = summary_figure(data, present, smooth) if name == "summary" else metric_figure(data, name, smooth)
        written.append(out_dir / f"{name}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a run dir, or a metrics.jsonl")
    parser.add_argument("--out", default="plots", help="folder for the PNGs (default: plots)")
    parser.add_argument("--labels", help="comma-separated legend labels, one per RUN (default: run dir names)")
    others = ",".join(m for m in UNITS if m not in DEFAULT_METRICS)
    parser.add_argument("--metrics", default=",".join(DEFAULT_METRICS),
                        help=f"comma-separated (default: %(default)s; also {others}, or any other key)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over N logged rows (default: 1, raw)")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        parser.error(f"--labels has {len(labels)} labels for {len(args.runs)} runs")
    if args.smooth < 1:
        parser.error("--smooth must be at least 1")
    try:
        written = plot_runs(args.runs, args.out, [m for m in args.metrics.split(",") if m], labels, args.smooth)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not written:
        print("error: nothing to plot", file=sys.stderr)
        return 1
    print("\n".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
