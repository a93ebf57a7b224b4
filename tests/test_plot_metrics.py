"""parallel3d-plot: the lines drawn are the logged metrics, and the PNGs are real images."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_hex

from parallel3d.base import GIB
from parallel3d.cli.plot_metrics import DEFAULT_METRICS, load_metrics, main, metric_figure, plot_runs, run_labels


def row(step: int, loss: float, **extra) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0 / step, "lr": 1e-3 * step, "tokens_per_sec": 1000.0 + step,
            "step_time_s": 0.1, "mfu": None, "max_memory_bytes": (step + 1) * GIB // 2, "param_bytes": 4096,
            "grad_bytes": 4096, "optim_state_bytes": 8192, **extra}


def write_run(run_dir: Path, rows: list[dict]) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def labelled_lines(fig) -> dict[str, tuple[list, list]]:
    """Legend label -> (x, y) of each run's line (a smoothed plot's faint raw lines are unlabelled)."""
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines() if not line.get_label().startswith("_")}


@pytest.fixture
def two_runs(tmp_path):
    a = write_run(tmp_path / "a" / "run", [row(s, 5.0 - s) for s in (1, 2, 3, 4)])
    b = write_run(tmp_path / "b" / "run", [row(s, 9.0 - 2 * s, mfu=0.1 * s) for s in (2, 4)])
    return a, b


def test_load_metrics_sorts_by_step_and_keeps_the_last_row_of_a_repeated_step(tmp_path):
    rows = [row(1, 4.0), row(3, 3.0), row(2, 2.5), row(2, 2.0)]
    path = write_run(tmp_path / "resumed", rows) / "metrics.jsonl"
    with path.open("a") as f:
        f.write('{"step": 4, "lo')  # a run killed mid-write
    assert [(r["step"], r["loss"]) for r in load_metrics(path)] == [(1, 4.0), (2, 2.0), (3, 3.0)]
    assert load_metrics(path.parent) == load_metrics(path)


@pytest.mark.fast
def test_lines_are_the_logged_values_per_run(two_runs):
    a, b = two_runs
    data = dict(zip(run_labels([a, b]), map(load_metrics, [a, b])))
    assert list(data) == ["a/run", "b/run"]  # same dir name: told apart by the parent
    assert run_labels([a, a / "metrics.jsonl"]) == ["run #0", "run #1"]
    fig = metric_figure(data, "loss")
    assert labelled_lines(fig) == {"a/run": ([1, 2, 3, 4], [4, 3, 2, 1]), "b/run": ([2, 4], [5, 1])}
    plt.close(fig)
    fig = metric_figure(data, "max_memory_bytes")  # in GiB
    assert labelled_lines(fig) == {"a/run": ([1, 2, 3, 4], [1, 1.5, 2, 2.5]), "b/run": ([2, 4], [1.5, 2.5])}
    assert "GiB" in fig.axes[0].get_title()
    plt.close(fig)
    fig = metric_figure(data, "mfu")  # null on run a (CPU): only run b's line, in percent
    assert labelled_lines(fig) == {"b/run": ([2, 4], pytest.approx([20, 40]))}
    assert to_hex(fig.axes[0].get_lines()[0].get_color()) == to_hex("C1")  # run b's color in every plot
    plt.close(fig)


def test_smoothing_draws_a_trailing_mean_over_the_raw_line(two_runs):
    a, _ = two_runs
    fig = metric_figure({"a": load_metrics(a)}, "loss", n=2)
    raw, smoothed = fig.axes[0].get_lines()
    assert list(raw.get_ydata()) == [4, 3, 2, 1] and raw.get_label().startswith("_")
    assert list(smoothed.get_ydata()) == [4, 3.5, 2.5, 1.5] and smoothed.get_label() == "a"
    plt.close(fig)
    fig = metric_figure({"a": load_metrics(a)}, "lr", n=2)  # exact values are not smoothed
    assert [list(line.get_ydata()) for line in fig.axes[0].get_lines()] == [pytest.approx([1e-3, 2e-3, 3e-3, 4e-3])]
    plt.close(fig)


def test_plot_runs_writes_a_png_per_metric_and_a_summary(two_runs, tmp_path, capsys):
    out = tmp_path / "plots"
    paths = plot_runs(two_runs, out, metrics=["loss", "max_memory_bytes", "no_such_metric"], labels=["x", "y"])
    assert [p.name for p in paths] == ["loss.png", "max_memory_bytes.png", "summary.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, channels = matplotlib.image.imread(path).shape
        assert height > 200 and width > 400 and channels in (3, 4)
    assert "skipping no_such_metric" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one distinct label per run"):
        plot_runs(two_runs, out, labels=["x", "x"])


def test_cli(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "cli"
    assert main([str(a), str(b / "metrics.jsonl"), "--out", str(out), "--metrics", "loss,mfu", "--smooth", "3"]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(out / f"{m}.png") for m in ("loss", "mfu", "summary")]
    assert all(np.asarray(matplotlib.image.imread(p)).size for p in written)


def test_a_run_without_metrics_is_a_one_line_error(two_runs, tmp_path, capsys):
    assert main([str(two_runs[0]), str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: no metrics.jsonl at {tmp_path / 'nowhere'}"
    assert not (tmp_path / "out").exists()


def test_per_rank_step_time_and_val_loss_are_plotted_by_default(tmp_path):
    rows = [row(s, 5.0 - s, step_time_max_s=0.5 * s, step_time_min_s=0.1 * s) for s in (1, 2, 3)]
    rows[-1]["val_loss"] = 2.5
    run = write_run(tmp_path / "ranks", rows)
    assert {"val_loss", "step_time_ranks"} <= set(DEFAULT_METRICS)
    fig = metric_figure({"r": load_metrics(run)}, "step_time_ranks")
    slowest, fastest = fig.axes[0].get_lines()
    assert list(slowest.get_ydata()) == pytest.approx([0.5, 1.0, 1.5]) and slowest.get_label() == "r"
    assert list(fastest.get_ydata()) == pytest.approx([0.1, 0.2, 0.3]) and fastest.get_linestyle() == "--"
    assert len(fig.axes[0].collections) == 1  # the band between them
    plt.close(fig)
    written = plot_runs([run], tmp_path / "plots")
    assert {"val_loss.png", "step_time_ranks.png", "summary.png"} <= {p.name for p in written}
