"""The training loop end to end: the default recipe, the run directory contract, stops, sweeps."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from harness.parity import PARITY_STEPS, assert_matches
from harness.runs import FAST, STEPS, Run, env, launch, relative_error
from harness.tolerance import measure, twins

from parallel3d.optim.schedule import lr_factor

CONTRACT = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "max_memory_bytes"}
SHORT = ["train.steps=3", "optim.warmup_steps=1"]
# One-process runs whose claims are about the training loop, not its command line: the session's run
# store (tests/harness/store.py) trains the selected ones in one launch, which pays a rank's start-up
# once for all of them. name: (the tests that read it, overrides)
RERUN_READERS = ("test_a_new_run_in_an_old_run_dir_starts_a_fresh_record",
                 "test_a_literal_run_dir_is_also_hydras_output_dir")
ONE_PROCESS = {
    **{f"zero{stage}": (("test_one_process_trains_alike_at_every_zero_stage",),
                        [*FAST, f"train.steps={PARITY_STEPS}", f"parallel.zero_stage={stage}",
                         "train.micro_batch_size=4"]) for stage in (0, 1)},
    "wsd": (("test_log_every_and_wsd_schedule",), [*FAST, "optim=adamw_wsd", "logging.log_every=4"]),
    "timing": (("test_step_time_covers_the_steps_since_the_last_log",),
               [*FAST, "train.steps=5", "logging.log_every=3"]),
    "old-record": (RERUN_READERS, [*FAST, "train.steps=2"]),
    # the default recipe, short, and its twins (the tolerance they imply): what the 3d recipe must match
    **{name: (("test_3d_recipe_trains_like_the_default_recipe",), overrides)
       for name, overrides in {"default": SHORT, **twins("default", SHORT)}.items()},
    "bf16-wandb": (("test_bfloat16_one_process_and_offline_wandb",),
                   [*FAST, "train.steps=3", "train.param_dtype=bfloat16", "logging=wandb"]),
}


@pytest.fixture(scope="module")
def one_process(run_store, request) -> dict[str, Run]:
    """The ONE_PROCESS runs of the tests that will run (after -k, --lf, ...), read-only."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    wanted = {name: (1, overrides) for name, (tests, overrides) in ONE_PROCESS.items() if selected & set(tests)}
    return {name: Run.from_record(record) for name, record in run_store.get(wanted).items()}


@pytest.fixture(scope="module")
def rerun(tmp_path_factory, one_process) -> Run:
    """The command line, with a literal run_dir, training the same run again in a copy of the folder
    its first run wrote (the store's runs are read-only), alone in its working directory."""
    old = shutil.copytree(one_process["old-record"].run_dir, tmp_path_factory.mktemp("rerun") / "again")
    assert [r["step"] for r in Run(old, 0, "", "").metrics] == [1, 2]
    return launch(old, [*FAST, "train.steps=2"])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Run:
    """`python -m parallel3d.train` with no arguments at all, as the quickstart runs it."""
    cwd = tmp_path_factory.mktemp("quickstart")
    proc = subprocess.run([sys.executable, "-m", "parallel3d.train"], capture_output=True, text=True,
                          timeout=300, env=env(), cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = [p.parent for p in (cwd / "outputs").glob("*/*/metrics.jsonl")]  # Hydra's outputs/DATE/TIME
    assert len(run_dirs) == 1, list(cwd.rglob("*"))
    return Run(run_dirs[0], proc.returncode, proc.stdout, proc.stderr)


def test_default_recipe_learns(default_run):
    losses = default_run.losses
    assert len(losses) == 60
    first, last = losses[0], sum(losses[-10:]) / 10
    assert last < 0.6 * first, losses  # byte-level Python source: from ~ln(512) to well below


def test_metrics_follow_the_contract(default_run):
    rows = default_run.metrics
    assert [r["step"] for r in rows] == list(range(1, 61))
    for row in rows:
        assert CONTRACT <= row.keys()
        assert row["mfu"] is None  # CPU: no peak FLOPs to divide by, so no invented MFU
        assert row["tokens_per_sec"] > 0 and row["max_memory_bytes"] > 0 and row["grad_norm"] > 0
    expected = [3e-3 * lr_factor(s - 1, steps=60, warmup=6, schedule="cosine", min_ratio=0.1, decay_fraction=0.2)
                for s in range(1, 61)]
    assert relative_error([r["lr"] for r in rows], expected) < 1e-9


def test_config_yaml_is_resolved(default_run):
    config = yaml.safe_load((default_run.run_dir / "config.yaml").read_text())
    assert config["recipe"] == "tiny_cpu"
    assert config["run_dir"] == str(default_run.run_dir)
    assert config["parallel"]["dp_shard"] == 1  # -1 resolved for one process
    assert config["model"]["name"] == "tiny" and config["train"]["steps"] == 60
    assert "${" not in (default_run.run_dir / "config.yaml").read_text()


def test_console_shows_progress(default_run):
    assert "model tiny 0.92M params" in default_run.stdout
    assert "[60/60] loss" in default_run.stdout and "eta" in default_run.stdout


def test_divergence_stops_with_the_step(tmp_path):
    run = launch(tmp_path / "nan", [*FAST, "optim.lr=1e4", "optim.warmup_steps=0", "train.grad_clip=0"])
    assert run.returncode == 3, run.stderr
    assert "Traceback" not in run.stderr
    stopped = len(run.metrics) + 1
    assert f"at step {stopped}: training diverged" in run.stderr, run.stderr
    assert stopped < STEPS


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_one_process_trains_alike_at_every_zero_stage(one_process, parity, zero_stage):
    """Without data parallelism a ZeRO stage has nothing to shard or reduce: accumulating micro
    batches trains as the default single process does (another order of the same sums: within the
    tolerance its sensitivity implies, tests/harness/tolerance.py)."""
    run = one_process[f"zero{zero_stage}"]
    run.assert_finished(PARITY_STEPS)
    assert_matches(parity.reference(), run, tolerance=parity.tolerance(), metrics=("loss",))


def test_log_every_and_wsd_schedule(one_process):
    run = one_process["wsd"]
    run.assert_finished(STEPS)
    assert [r["step"] for r in run.metrics] == [4, 8, STEPS]  # and always the last step
    expected = [3e-3 * lr_factor(s - 1, steps=STEPS, warmup=2, schedule="wsd", min_ratio=0.0, decay_fraction=0.2)
                for s in (4, 8, STEPS)]
    assert [r["lr"] for r in run.metrics] == pytest.approx(expected)
    assert run.metrics[0]["lr"] == pytest.approx(3e-3)  # on the plateau


def test_hydra_multirun_gives_each_job_its_run_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "parallel3d.train", "--multirun", "optim.lr=1e-3,2e-3",
                           "train.steps=3", "optim.warmup_steps=0", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                          capture_output=True, text=True, timeout=300, env=env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lrs = {}
    for job in ("0", "1"):
        rows = [json.loads(line) for line in (tmp_path / "sweep" / job / "metrics.jsonl").read_text().splitlines()]
        lrs[job] = rows[0]["lr"]
    assert lrs == {"0": 1e-3, "1": 2e-3}


def test_bfloat16_one_process_and_offline_wandb(one_process):
    run = one_process["bf16-wandb"]
    run.assert_finished(3)
    assert all(r["loss"] < 7 for r in run.metrics)
    assert list((run.run_dir / "wandb").glob("offline-run-*/run-*.wandb")), list(run.run_dir.rglob("*"))


@pytest.mark.multirank
def test_launcher_runs_torchrun_with_mixed_precision_fsdp(tmp_path, reference_run):
    run = launch(tmp_path / "launcher", [*FAST, f"train.steps={PARITY_STEPS}", "parallel=zero2",
                                         "train.param_dtype=bfloat16", "train.micro_batch_size=4"], nproc=2,
                 launcher="parallel3d-run")
    run.assert_finished(PARITY_STEPS)
    # bf16 compute, fp32 master weights and reduction: close to the fp32 run, not equal to it.
    assert relative_error(run.losses, reference_run.losses) < 2e-2
    assert yaml.safe_load((run.run_dir / "config.yaml").read_text())["parallel"]["dp_shard"] == 2


def test_step_time_covers_the_steps_since_the_last_log(one_process):
    run = one_process["timing"]
    run.assert_finished(5)
    first, last = run.metrics  # steps 3 (three steps timed) and 5 (two steps)
    for row, steps in ((first, 3), (last, 2)):
        tokens = 16 * 64 * steps
        assert row["step_time_s"] * steps == pytest.approx(tokens / row["tokens_per_sec"], rel=1e-6)
        # one rank: its busy time (CPU time of the steps' work) is the slowest and the fastest, within the wall time
        assert row["step_time_min_s"] == row["step_time_max_s"] <= row["step_time_s"] and row["slowest_rank"] == 0


def test_a_new_run_in_an_old_run_dir_starts_a_fresh_record(rerun):
    assert [r["step"] for r in rerun.metrics] == [1, 2]  # the old record's steps 1 and 2 are gone


@pytest.mark.multirank
def test_3d_recipe_trains_like_the_default_recipe(tmp_path, one_process):
    single, *perturbed = (one_process[name] for name in ("default", *twins("default", SHORT)))
    for run in (single, *perturbed):
        run.assert_finished(3)
    tolerance = measure(single, *perturbed, metrics=("loss",), weights=False)
    three_d = launch(tmp_path / "3d", ["recipe=tiny_cpu_3d", *SHORT], nproc=8, launcher="parallel3d-run")
    three_d.assert_finished(3)
    assert_matches(single, three_d, tolerance=tolerance, metrics=("loss",))
    # torch logs these on every rank; the ranks but 0 send them to their log files (warnings_to_log)
    for warning in ("CPU process group does not support alltoall", "from (_NormPartial(2.0), _NormPartial(2.0))"):
        assert three_d.stderr.count(warning) == 1, three_d.stderr[-3000:]


def test_a_literal_run_dir_is_also_hydras_output_dir(tmp_path, rerun):
    """No empty outputs/DATE/TIME folder beside a run that names its run_dir."""
    from parallel3d.train import output_dir_is_run_dir

    argv = ["train.py", f"run_dir={tmp_path / 'r'}", "train.steps=2"]
    assert output_dir_is_run_dir(argv) == [*argv, f"hydra.run.dir=${{p3d.rank0_dir:'{tmp_path / 'r'}'}}"]
    for kept in (["train.py", "run_dir=${oc.env:X}"], ["train.py", "run_dir=a", "hydra.run.dir=b"],
                 ["train.py", "--multirun", "run_dir=a"], ["train.py", "train.steps=2"]):
        assert output_dir_is_run_dir(kept) == kept
    rerun.assert_finished(2)
    assert sorted(p.name for p in rerun.run_dir.parent.iterdir()) == ["again"]


@pytest.mark.multirank
def test_hydra_multirun_under_torchrun_is_refused(tmp_path):
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "parallel3d.train", "--multirun", "optim.lr=1e-3,3e-3"], capture_output=True,
                          text=True, timeout=300, env=env(), cwd=tmp_path)
    assert done.returncode != 0
    assert "parallel3d: config error: --multirun=under torchrun" in done.stderr and "parallel3d-run" in done.stderr
    assert not (tmp_path / "multirun").exists() or not any((tmp_path / "multirun").rglob("metrics.jsonl"))
