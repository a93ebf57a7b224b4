"""Hydra sweeps with torchrun underneath: ``parallel3d-run --multirun``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness.parity import assert_matches
from harness.runs import FAST, Run, env, refused_by_the_launcher
from omegaconf import OmegaConf

from parallel3d.launch.sweep import expand, plan


@pytest.mark.fast
def test_expand_follows_hydra_sweep_syntax():
    jobs = expand(["recipe=tiny_cpu", "optim.lr=1e-3,3e-3", "parallel.tp=range(1,3)", "+slurm.env.A=choice(x,y)"])
    assert [varies for _, varies in jobs] == [
        ["optim.lr=0.001", "parallel.tp=1", "+slurm.env.A=x"], ["optim.lr=0.001", "parallel.tp=1", "+slurm.env.A=y"],
        ["optim.lr=0.001", "parallel.tp=2", "+slurm.env.A=x"], ["optim.lr=0.001", "parallel.tp=2", "+slurm.env.A=y"],
        ["optim.lr=0.003", "parallel.tp=1", "+slurm.env.A=x"], ["optim.lr=0.003", "parallel.tp=1", "+slurm.env.A=y"],
        ["optim.lr=0.003", "parallel.tp=2", "+slurm.env.A=x"], ["optim.lr=0.003", "parallel.tp=2", "+slurm.env.A=y"]]
    assert all(job[0] == "recipe=tiny_cpu" for job, _ in jobs)
    assert expand(["train.steps=3"]) == [(["train.steps=3"], [])]


def test_plan_gives_each_job_its_own_run_dir(tmp_path):
    jobs = plan([f"run_dir={tmp_path}", "hydra.run.dir=ignored", "optim.lr=1,2"])
    assert [job.run_dir for job in jobs] == [tmp_path / "0", tmp_path / "1"]
    assert [job.overrides for job in jobs] == [
        [f"optim.lr={lr}", f"hydra.run.dir=${{p3d.rank0_dir:'{tmp_path / str(n)}'}}"] for n, lr in enumerate((1, 2))]


def run_sweep(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel3d.launch.run", "--standalone", "--nproc-per-node=2",
                           "--multirun", *args], capture_output=True, text=True, timeout=600, env=env(), cwd=cwd)


@pytest.mark.multirank
def test_sweep_over_layouts_runs_one_torchrun_per_job(tmp_path, parity):
    """Two layouts of the same model: each job in its own folder, the same losses in both."""
    root = tmp_path / "sweep"
    done = run_sweep([f"run_dir={root}", *FAST, "train.steps=3", "parallel.tp=1,2"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = json.loads((root / "sweep.json").read_text())
    assert [job["swept"] for job in jobs] == ["parallel.tp=1", "parallel.tp=2"]
    runs = [Run(root / str(n), done.returncode, done.stdout, done.stderr) for n in range(2)]
    for run, tp in zip(runs, (1, 2)):
        run.assert_finished(3)
        config = OmegaConf.load(run.run_dir / "config.yaml")
        assert (config.parallel.tp, config.run_dir) == (tp, str(run.run_dir))
    # two layouts: within the default family's tolerance (tests/harness/tolerance.py); 3 of its 10 steps
    assert_matches(runs[0], runs[1], tolerance=parity.tolerance(), metrics=("loss",))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # no stray Hydra output folders


def test_a_bad_combination_stops_the_sweep_before_it_starts(tmp_path, monkeypatch, capsys):
    code, stderr = refused_by_the_launcher(["--standalone", "--nproc-per-node=2", "--multirun",
                                            f"run_dir={tmp_path / 'sweep'}", "parallel.tp=2,3"], monkeypatch, capsys)
    assert code == 2
    assert "sweep job 1 (parallel.tp=3)" in stderr and "parallel.tp" in stderr
    assert not (tmp_path / "sweep").exists()
