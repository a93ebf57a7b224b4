"""The benchmark tools: bench_overhead compares loops that train identically (and refuses the
others), bench_comm puts the planner's bytes beside the measured ones, bench_optimizer times
implementations that compute the same update (and refuses the others), bench_gpu runs its four
loops (here on CPU, where it reports no MFU or allocator peak)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_comm  # noqa: E402
import bench_gpu  # noqa: E402
import bench_optimizer  # noqa: E402
import bench_overhead  # noqa: E402
import parity_sensitivity  # noqa: E402

from parallel3d.config.compose import compose

SMALL = ["train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2", "logging.log_every=2"]


def test_reports_per_step_times_of_two_loops_that_train_alike(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert bench_overhead.main(["--repeats", "1", "--steps", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    agreement = float(re.search(r"Losses of the two loops agree to (\S+) \(relative\)", out).group(1))
    assert agreement <= 1e-5
    for loop in ("parallel3d", "plain"):  # per-step CPU and wall times and their medians (values not judged)
        row = next(line for line in out.splitlines() if line.startswith(f"| {loop} |"))
        assert len([float(v) for cell in row.split("|")[2:-1] for v in cell.split(",")]) == 4
    assert re.search(r"Overhead: [+-]\d+\.\d% CPU time, [+-]\d+\.\d% wall time", out)


def test_refuses_to_compare_loops_that_train_differently(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    real = bench_overhead.plain
    monkeypatch.setitem(bench_overhead.LOOPS, "plain", lambda o, d: [x * 1.01 for x in real(o, d)])
    assert bench_overhead.main(["--repeats", "1", "--steps", "2", *SMALL]) == 1
    assert "trained differently" in capsys.readouterr().out


def test_bench_comm_puts_the_planner_beside_every_measured_collective():
    layouts = {name: bench_comm.LAYOUTS[name] for name in ("zero1", "tp2 sp", "pp2 1F1B")}
    rows = [row.split(" | ") for row in bench_comm.table(layouts)[2:]]
    kinds = {(r[0].lstrip("| "), r[2], r[3]) for r in rows}
    assert {("zero1", "dp_shard", "all_gather"), ("zero1", "dp_shard", "reduce_scatter"),
            ("tp2 sp", "tp", "all_gather"), ("pp2 1F1B", "pp", "send")} <= kinds
    for layout, rank, dim, kind, calls, payload, sent, planned in rows:
        if planned.rstrip(" |") != "(scalars)":  # the planner leaves out the grad norm's floats
            assert planned.rstrip(" |") == sent, (layout, dim, kind)


def test_bench_optimizer_times_implementations_that_agree(capsys, monkeypatch):
    assert bench_optimizer.main(["--steps", "1", "model.n_layers=1"]) == 0
    out = capsys.readouterr().out
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| f")] == ["| fused", "| foreach",
                                                                                            "| for_loop"]
    real = bench_optimizer.optimizer_over

    def wrong_lr(params, implementation):
        optimizer, copies = real(params, implementation)
        if implementation == "foreach":
            optimizer.param_groups[0]["lr"] *= 2
        return optimizer, copies

    monkeypatch.setattr(bench_optimizer, "optimizer_over", wrong_lr)
    assert bench_optimizer.main(["--steps", "1", "model.n_layers=1"]) == 1
    assert "disagree" in capsys.readouterr().out


def test_bench_gpu_runs_its_loops_and_the_plain_ones_train_alike(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bf16 = [loop for loop in bench_gpu.LOOPS if "float8" not in loop]  # float8 compiled on the CPU: too slow here
    assert bench_gpu.main(["--case", "1b", "--steps", "2", "--log-every", "1", "train.device=cpu", "model=tiny",
                           "train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4",
                           "train.float8_skip_small=false", *(f"--loop={loop}" for loop in bf16)]) == 0
    out = capsys.readouterr().out
    eager, compiled = (float(v) for v in re.search(r"plain, eager (\S+), plain, compiled (\S+)\.", out).groups())
    assert eager <= 1e-5 and compiled <= 1e-3  # same kernels eager; compiled graphs fuse differently
    assert "float8 converts 28 (tensorwise) and 28 (rowwise) of 29 linears" in out  # all but the head
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| ") and "loop" not in line]
    assert [r[0].lstrip("| ") for r in rows] == bf16
    assert all(float(r[2].replace(",", "")) > 0 for r in rows)  # tokens/s
    tiny = bench_gpu.flop_counts(compose(["model=tiny"]).model, 32)  # 6N + attention, and its causal half
    assert tiny["6N + attention"] - tiny["6N + causal half"] == 6 * 4 * 128 * 32


def test_parity_summary_tabulates_each_family_margin(capsys, tmp_path):
    """parity_sensitivity summarize: per reference, kernel set and metric, the largest error over the
    spread (and which layout) and the smallest tolerance over the error; plain bounds are left out."""
    rows = [{"reference": "ref", "capability": "AVX2", "run": run, "errors": {"loss": error},
             "tolerances": {"loss": 1e-6}, "spreads": {"loss": 1e-7}} for run, error in (("a", 2e-7), ("b", 4e-7))]
    rows.append({"reference": "bf16", "capability": "AVX2", "run": "c", "errors": {"loss": 1e-3},
                 "tolerances": {"loss": 1e-2}, "spreads": None})
    log = tmp_path / "parity.jsonl"
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert parity_sensitivity.main(["summarize", str(log)]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ref |")]
    assert table == ["| ref | AVX2 | loss | 2 | 4 (b) | 2.5 |"]

