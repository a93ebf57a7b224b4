"""Per-rank timing and stragglers (parallel3d/observe/meter.py, straggler.py) and profiler traces
(parallel3d/observe/profiling.py), on real 4-rank runs: one launch trains all four layouts, and
other files' 4-rank runs with them (tests/harness/shared_runs.py)."""

from __future__ import annotations

import json
import re

import pytest
from harness.shared_runs import shared_runs

from parallel3d.runtime.straggler import StragglerWatch

# Short runs of the tiny model: a rank that computes 0.5 s longer is many times the others' step.
SHORT = ["train.steps=5", "optim.warmup_steps=1", "train.seq_len=32", "train.global_batch_size=8",
         "train.micro_batch_size=2", "logging.straggler_steps=2"]
LAYOUTS = {
    "slow-rank-2": [*SHORT, "debug.slow_rank=2", "debug.slow_rank_s=0.5"],
    "no-slow-rank": SHORT,
    "dp2-tp2-profiled": [*SHORT, "parallel.tp=2", "profile.steps=[3,4]"],
    "pp2-dp2-profiled": [*SHORT, "parallel.pp=2", "parallel.pp_schedule=1F1B", "train.micro_batch_size=1",
                         "profile.steps=[3,4]", "profile.ranks=[0,1,2]", "profile.memory=true"],
}
STRAGGLER = re.compile(r"parallel3d: straggler: rank (\d+) on (\S+) took")


# Trained in one 4-rank launch with other files' 4-rank runs (tests/harness/shared_runs.py).
SHARED = {name: (4, overrides) for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module")
def runs(run_store, request):
    """The four layouts, from the session's shared launches (any that failed there, launched on its own)."""
    done = shared_runs(run_store, request.session, request.module)
    for run in done.values():
        run.assert_finished(5)
    return done


@pytest.mark.multirank
def test_a_slow_rank_is_named_in_the_metrics_and_on_the_console(runs):
    slow = runs["slow-rank-2"]
    assert [row["slowest_rank"] for row in slow.metrics] == [2] * 5
    for row in slow.metrics[1:]:  # (the first step warms up)
        # A lower bound only: the other ranks' step time is the machine's load, not a claim.
        assert row["step_time_max_s"] >= 0.5, row
        assert 0 <= row["data_wait_min_s"] <= row["data_wait_max_s"] and 0 <= row["slowest_data_rank"] < 4
    named = STRAGGLER.findall(slow.stdout)
    assert [rank for rank, _ in named] == ["2"], slow.stdout  # once, after straggler_steps logged steps
    assert named[0][1] == __import__("socket").gethostname()

    even = runs["no-slow-rank"]
    assert not STRAGGLER.findall(even.stdout), even.stdout  # (its step times are the load's: not asserted)


@pytest.mark.multirank
@pytest.mark.parametrize("name, ranks", [("dp2-tp2-profiled", [0, 1, 2, 3]), ("pp2-dp2-profiled", [0, 1, 2])])
def test_profiled_steps_write_a_chrome_trace_per_rank_with_the_collectives(runs, name, ranks):
    run = runs[name]
    folder = run.run_dir / "profile"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["step3"]
    assert sorted(p.name for p in (folder / "step3").glob("rank*.json")) == [f"rank{r}.json" for r in ranks]
    for rank in ranks:
        events = json.loads((folder / "step3" / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events if e.get("ph") == "X"}
        assert "aten::mm" in names
        assert any(n.startswith("gloo:") for n in names) and any(n.startswith("c10d::") for n in names), names
        if name.startswith("pp2"):  # the stage-to-stage activations
            assert {"gloo:send", "gloo:recv"} <= names or {"c10d::send", "c10d::recv_"} <= names, names
    summary = re.findall(r"parallel3d: profile: (\S+) \(2 steps\): per step ([\d.]+) ms in communication", run.stdout)
    assert summary and summary[0][0] == str(folder / "step3" / "rank0.json") and float(summary[0][1]) > 0
    assert "per step" in (run.run_dir / "logs" / "rank1.log").read_text()  # the other ranks' summaries


@pytest.mark.multirank
def test_profile_memory_on_cpu_says_what_it_cannot_do_and_compares_with_the_planner(runs):
    out = runs["pp2-dp2-profiled"].stdout
    assert "profile.memory on CPU: no CUDA memory snapshots" in out
    compared = re.findall(r"parallel3d: memory: rank (\d) measured [\d.]+ GiB .* planner predicted [\d.]+ GiB", out)
    assert compared == ["0", "1", "2", "3"], out


@pytest.mark.fast
def test_a_straggler_is_named_once_per_streak():
    watch = StragglerWatch(factor=2.0, steps=2, hosts=["a", "b", "c"])
    assert watch.check(1, [1.0, 1.0, 3.0]) == []  # one logged step: not yet
    (line,) = watch.check(2, [1.0, 1.0, 3.0])
    assert line.startswith("parallel3d: straggler: rank 2 on c took 3.000 s per step, 3.0x the ranks' median")
    assert watch.check(3, [1.0, 1.0, 3.0]) == []  # still slow: said already
    assert watch.check(4, [1.0, 1.0, 1.5]) == []  # recovered
    assert watch.check(5, [1.0, 1.0, 3.0]) == [] and len(watch.check(6, [1.0, 1.0, 3.0])) == 1
    assert StragglerWatch(factor=0.0, steps=1, hosts=["a", "b"]).check(1, [1.0, 9.0]) == []  # off


def test_out_of_memory_is_one_line_naming_the_fix(tmp_path):
    import torch
    from omegaconf import OmegaConf

    from parallel3d.config.compose import compose
    from parallel3d.observe.profiling import StepProfiler, is_communication

    c = OmegaConf.to_object(compose([f"run_dir={tmp_path}"]))
    profiler = StepProfiler(c, tmp_path, 0, 1, torch.device("cpu"), say=print)
    error = profiler.out_of_memory(7)
    assert str(error) == ("rank 0 ran out of GPU memory at step 7. Fix: set profile.memory=true and "
                          "profile.steps=[7, 7] to record what held the memory, or see docs/planner.md for a "
                          "layout that fits")
    assert all(map(is_communication, ["c10d::allreduce_", "gloo:all_gather", "nccl:all_reduce",
                                      "_c10d_functional::wait_tensor", "ncclDevKernel_AllGather_RING_LL"]))
    assert not any(map(is_communication, ["aten::mm", "aten::copy_", "Optimizer.step#AdamW.step"]))


def test_our_collectives_use_torchs_current_names():
    """Every multi-rank run printed torch's FutureWarning for ``all_gather_into_tensor``: the
    meter's per-rank gather and context parallelism's document-id gather call it under its current
    name (``all_gather_single``), here on a one-rank gloo group with FutureWarning an error."""
    import warnings

    import torch
    import torch.distributed as dist

    from parallel3d.observe.meter import gather_per_rank
    from parallel3d.parallel.context import alltoall_attention

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            assert gather_per_rank([1.0, 2.0], torch.device("cpu")) == [[1.0, 2.0]]
            q = torch.randn(1, 2, 4, 8)
            out = alltoall_attention(q, q, q, torch.zeros(1, 4, dtype=torch.long), dist.group.WORLD, 1)
            assert out.shape == q.shape
    finally:
        dist.destroy_process_group()
