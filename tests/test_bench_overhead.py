"""tools/bench_overhead.py: both loops train identically, and the tool refuses to compare loops
that do not."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_overhead  # noqa: E402

SMALL = ["train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "logging.log_every=2"]


def test_reports_per_step_times_of_two_loops_that_train_alike(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert bench_overhead.main(["--repeats", "1", "--steps", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    agreement = float(re.search(r"Losses of the two loops agree to (\S+) \(relative\)", out).group(1))
    assert agreement <= 1e-5
    for loop in ("parallel3d", "plain"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {loop} |"))
        assert all(float(cell) > 0 for cell in row.split("|")[2:-1] if cell.strip())
    assert re.search(r"Overhead: [+-]\d+\.\d% CPU time, [+-]\d+\.\d% wall time", out)


def test_refuses_to_compare_loops_that_train_differently(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    real = bench_overhead.plain
    monkeypatch.setitem(bench_overhead.LOOPS, "plain", lambda o, d: [x * 1.01 for x in real(o, d)])
    assert bench_overhead.main(["--repeats", "1", "--steps", "2", *SMALL]) == 1
    assert "trained differently" in capsys.readouterr().out
