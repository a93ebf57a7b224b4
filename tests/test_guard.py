"""Bad steps (parallel3d/runtime/guard.py): one decision of all ranks, skipped or stopped, rolled back.

The guard's rules are unit tests (one process, and two gloo ranks that see different losses);
end to end, ``debug.nan_steps`` poisons a step in one process and in dp2 x tp2 and pp2 layouts,
batched per rank count, with other files' runs (tests/harness/shared_runs.py), and every layout
must skip it alike.
"""

from __future__ import annotations

import json
import math
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness.parity import assert_matches
from harness.runs import FAST, STEPS, launch_batch, tensorboard_scalars
from harness.shared_runs import shared_runs
from harness.tolerance import measure, twins

from parallel3d.runtime.guard import SPIKE_MIN_STEPS, BadStepGuard, TrainingDiverged

NAN_AT_7 = [*FAST, "debug.nan_steps=[7]", "train.on_bad_step=skip"]
# Trained in launches shared with other files' runs of these rank counts (tests/harness/shared_runs.py).
SHARED = {"dp2_tp2": (4, [*NAN_AT_7, "parallel.dp_shard=2", "parallel.tp=2"]),
          "pp2": (2, [*NAN_AT_7, "parallel.pp=2", "train.micro_batch_size=2"])}


def guard(**overrides) -> BadStepGuard:
    return BadStepGuard(**{"on_bad_step": "skip", "spike_factor": 0.0, "max_bad_steps": 3, **overrides})


def decide(g: BadStepGuard, step: int, loss: float, norm: float) -> bool:
    g.begin(step)
    return g.update_allowed(torch.tensor(loss), torch.tensor(norm))


@pytest.mark.fast
def test_non_finite_loss_or_norm_is_skipped_and_counted():
    g = guard()
    assert decide(g, 1, 2.0, 1.0) and not g.skipped
    assert not decide(g, 2, math.nan, 1.0) and g.skipped and "loss is not finite" in g.reason
    assert not decide(g, 3, 2.0, math.inf) and g.reason == "grad norm is inf"
    assert g.skipped_steps == 2 and not g.rollback_due
    assert decide(g, 4, 2.0, 1.0) and g.skipped_steps == 2 and g.bad_in_a_row == 0
    assert list(g.recent_norms) == [1.0, 1.0]  # bad steps do not enter the median


def test_stop_names_the_step():
    with pytest.raises(TrainingDiverged, match="loss is not finite .* at step 7: training diverged"):
        decide(guard(on_bad_step="stop"), 7, math.nan, math.nan)


def test_spike_over_the_running_median_once_there_are_enough_steps():
    g = guard(spike_factor=4.0)
    assert decide(g, 1, 2.0, 100.0)  # the first steps are never spikes: no median yet
    for step in range(2, SPIKE_MIN_STEPS + 2):
        assert decide(g, step, 2.0, 1.0 + step % 3 * 0.1)  # median 1.1
    assert decide(g, 100, 2.0, 4.3)  # 3.9 x the median
    assert not decide(g, 101, 2.0, 4.5)
    assert "over train.spike_factor=4 x the median 1.1 of the last" in g.reason
    assert decide(guard(spike_factor=0.0, max_bad_steps=1), 1, 2.0, 1e30)  # 0: off


def test_rollback_after_max_bad_steps_skips_the_data_and_stops_the_second_time():
    g = guard(max_bad_steps=2, nan_steps=[7, 8])
    for step in (7, 8):
        g.begin(step)
        assert g.inject_nan
        assert not g.update_allowed(torch.tensor(math.nan), torch.tensor(math.nan))
    assert g.rollback_due
    line = g.rolled_back(at_step=8, to_step=5, global_batch_size=16)
    assert "rolled back to step_5" in line and "3 steps of data skipped" in line
    assert g.rollbacks == [{"at_step": 8, "to_step": 5, "skipped_steps": 3, "skipped_samples": 48}]
    g.begin(7)
    assert not g.inject_nan  # step 7 now trains on step 10's batch
    resumed = guard(max_bad_steps=2)
    resumed.load_state_dict(json.loads(json.dumps(g.state_dict())))  # as meta.json keeps it
    assert resumed.state_dict() == g.state_dict() and resumed.skipped_steps == 2
    with pytest.raises(TrainingDiverged, match="again after rolling back to step_5"):
        resumed.rolled_back(at_step=9, to_step=5, global_batch_size=16)


@pytest.mark.fast
def test_one_rank_bad_is_every_rank_bad():
    """Only rank 1 sees a NaN loss (a rank-local decision would update rank 0 and not rank 1): both
    skip. Two gloo ranks as threads of this process, over a store in memory."""
    store, decided = dist.HashStore(), {}

    def rank_decides(rank: int) -> None:
        g = guard(group=dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60)))
        decided[rank] = decide(g, 1, math.nan if rank == 1 else 2.0, 1.0), g.reason

    threads = [threading.Thread(target=rank_decides, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert decided == {0: (False, "loss is not finite (grad norm 1)"), 1: (False, "loss is not finite (grad norm 1)")}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_skipped_7(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["skipped"] for r in rows] == [s == 7 for s in range(1, STEPS + 1)]
    assert [r["skipped_steps"] for r in rows] == [int(s >= 7) for s in range(1, STEPS + 1)]
    assert math.isnan(rows[6]["loss"])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard1")
    rollback = [*FAST, "train.steps=12", "debug.nan_steps=[7,8]", "train.on_bad_step=skip",
                "train.max_bad_steps=2", "checkpoint.every=5", "logging.tensorboard=true"]
    resumed = [*rollback, f"checkpoint.resume={root / 'rollback' / 'checkpoints' / 'step_10'}"]
    layouts = {"skip": NAN_AT_7, **twins("skip", NAN_AT_7), "rollback": rollback, "resumed": resumed}
    runs = launch_batch(root, layouts, nproc=1)
    assert set(runs) == set(layouts), list((root).glob("*.batch/*"))
    return runs


@pytest.mark.multirank
def test_a_poisoned_step_is_skipped_alike_in_every_layout(tmp_path, one_process, run_store, request):
    """Step 7's loss is NaN on every rank: one process, dp2 x tp2 and pp2 skip it (no update, the lr
    schedule goes on) and train the same losses at every other step. The dp2 run with
    on_bad_step=stop ends at step 7 on every rank with one line naming it."""
    runs = shared_runs(run_store, request.session, request.module)
    # on_bad_step=stop is meant to fail, which would end a shared launch: it gets one of its own
    launch_batch(tmp_path, {"stop": [*FAST, "debug.nan_steps=[7]", "parallel.dp_shard=2"]}, nproc=2)
    reference = _metrics(one_process["skip"].run_dir)
    _assert_skipped_7(reference)
    assert "step 7 skipped: loss is not finite" in one_process["skip"].stdout
    for name in ("dp2_tp2", "pp2"):
        assert runs[name].returncode == 0, f"{name} failed: see {runs[name].run_dir}\n{runs[name].stderr[-3000:]}"
        rows = _metrics(runs[name].run_dir)
        _assert_skipped_7(rows)
        # the good steps, within what the one-process run's own sensitivity implies (tests/harness/tolerance.py)
        tolerance = measure(one_process["skip"], *(one_process[twin] for twin in twins("skip", NAN_AT_7)),
                            metrics=("loss",), weights=False)
        assert_matches(one_process["skip"], runs[name], tolerance=tolerance, metrics=("loss",))
        assert [r["lr"] for r in rows] == pytest.approx([r["lr"] for r in reference], rel=1e-12)
    results = [json.loads((tmp_path / "stop.batch" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["returncode"] for r in results] == [3, 3]
    lines = [line for line in results[0]["stderr"].splitlines() if line.startswith("parallel3d:")]
    assert len(lines) == 1 and "at step 7: training diverged" in lines[0], results[0]["stderr"]
    assert [r["step"] for r in _metrics(tmp_path / "stop")] == list(range(1, 7))


def test_bad_steps_in_a_row_roll_back_once_and_a_resume_continues_the_same_data(one_process):
    """nan_steps=[7,8] with max_bad_steps=2: after step 8 the run reloads step_5 and trains steps
    6..12 on the data of steps 9..15; step_10 records the skip, and a run resumed from it trains
    steps 11 and 12 as the rolled-back run did."""
    run = one_process["rollback"]
    assert "rolled back to step_5; steps 6.. train on the data after step 8 (3 steps of data skipped)" in run.stdout
    rows = _metrics(run.run_dir)
    assert [r["step"] for r in rows] == list(range(1, 13))  # the abandoned steps 6..8 were dropped
    curve = tensorboard_scalars(run.run_dir / "tensorboard")["loss"]  # and their points in TensorBoard
    assert [step for step, _ in curve] == list(range(1, 13))
    assert [value for _, value in curve] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert rows[-1]["skipped_steps"] == 2 and not any(r["skipped"] for r in rows)
    meta = json.loads((run.run_dir / "checkpoints" / "step_10" / "meta.json").read_text())
    assert meta["samples_seen"] == (10 + 3) * 16
    assert meta["guard"]["skipped_steps"] == 2
    assert meta["guard"]["rollbacks"] == [{"at_step": 8, "to_step": 5, "skipped_steps": 3, "skipped_samples": 48}]
    resumed = _metrics(one_process["resumed"].run_dir)
    assert [r["step"] for r in resumed] == [11, 12] and resumed[-1]["skipped_steps"] == 2
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows[10:]]  # the same layout: bit for bit


def test_no_checkpoint_to_roll_back_to_says_what_checkpoint_every_would_change():
    from parallel3d.config.schema import DebugConfig, TrainConfig
    from parallel3d.runtime.guard import BadStepGuard

    guard = BadStepGuard.for_run(TrainConfig(max_bad_steps=2), DebugConfig())
    unset = str(guard.nothing_to_roll_back_to(at_step=3, every=0))
    assert "2 bad steps in a row up to step 3" in unset and unset.endswith("or set checkpoint.every to roll back")
    due_later = str(guard.nothing_to_roll_back_to(at_step=3, every=5))
    assert "Set checkpoint.every" not in due_later and "set checkpoint.every" not in due_later, due_later
    assert due_later.endswith("checkpoint.every=5 saves its first checkpoint at step 5: set it below 3 to roll back "
                              "that early")
