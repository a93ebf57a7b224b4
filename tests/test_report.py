"""parallel3d-report: a run dir's summary says what the run wrote."""

from __future__ import annotations

import json

import pytest

from parallel3d.observe.report import main, report


def write_run(run_dir, rows):
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(
        "recipe: tiny_cpu\nmodel: {name: tiny}\ntrain: {steps: 10, param_dtype: float32, global_batch_size: 8, "
        "seq_len: 32}\nparallel: {dp_replicate: 1, dp_shard: 2, tp: 2, pp: 2, cp: 1, ep: 1, zero_stage: 3, "
        "pp_schedule: 1F1B}\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "lo')
    for step, complete in ((4, True), (8, True), (9, False)):
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
        if complete:
            (run_dir / "checkpoints" / f"step_{step}" / "COMPLETE").touch()
    (run_dir / "profile" / "step3").mkdir(parents=True)
    for rank in range(8):
        (run_dir / "profile" / "step3" / f"rank{rank}.json").write_text("{}")


def row(step, loss, slowest, **extra):
    return {"step": step, "loss": loss, "tokens_per_sec": 1000.0 * step, "step_time_s": 0.5, "mfu": None,
            "max_memory_bytes": step * 2**30, "max_memory_rank": 5, "step_time_max_s": 0.4,
            "step_time_min_s": 0.1, "slowest_rank": slowest, "data_wait_max_s": 0.002 * step,
            "data_wait_min_s": 0.0, "slowest_data_rank": 1, "skipped_steps": step // 4, **extra}


@pytest.mark.fast
def test_report_summarizes_a_run(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_run(run_dir, [row(s, 6.0 - s / 2, 3 if s > 2 else 0) for s in range(1, 9)] + [
        row(8, 2.0, 3, val_loss=2.25)])
    assert main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == report(run_dir)
    assert f"run:         {run_dir} (tiny_cpu)" in out
    assert "layout:      dp_shard 2 tp 2 pp 2 (1F1B), zero_stage 3 | model tiny" in out
    assert "steps:       8 of 10 logged (8 rows)" in out  # step 8 logged twice keeps its last row
    assert "loss:        5.5000 at step 1 -> 2.0000 (lowest 2.0000)" in out
    assert "val_loss:    2.2500 at step 8" in out
    assert "throughput:  4,500 tok/s, 0.500 s/step (medians)" in out
    assert "memory:      peak 8.00 GiB on rank 5 at step 8" in out
    assert "slowest:     rank 3 (6/8 rows), rank 0 (2/8 rows); slowest/fastest rank step time 4.00x" in out
    assert "data wait:   up to 16.0 ms/step on rank 1 at step 8" in out
    assert "skipped:     2 bad steps skipped" in out
    assert f"checkpoints: step_4, step_8 (newest {run_dir / 'checkpoints' / 'step_8'})" in out
    assert f"traces:      8 files in {run_dir / 'profile' / 'step3'}" in out


def test_a_folder_without_a_run_is_a_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"parallel3d-report: error: {tmp_path} has no config.yaml or "
                                               "metrics.jsonl: not a run dir")
