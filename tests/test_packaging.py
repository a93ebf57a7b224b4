"""A built wheel, installed into a throwaway virtual environment (never the global one), runs
from any directory: conf/ and recipes/ ship inside the package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_wheel_trains_from_another_directory(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                               ".benchmarks", "outputs", "multirun"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True)
    (wheel,) = (tmp_path / "dist").glob("parallel3d-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(OMP_NUM_THREADS="1", WANDB_MODE="offline")
    where = subprocess.run([python, "-c", "import parallel3d.config as c; print(c.CONF_DIR); print(c.RECIPES_DIR)"],
                           capture_output=True, text=True, cwd=elsewhere, env=environ, check=True).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where
    run = subprocess.run([python, "-m", "parallel3d.train", "recipe=tiny_cpu", f"run_dir={elsewhere / 'run'}",
                          "train.steps=2", "optim.warmup_steps=1", "train.seq_len=32", "train.global_batch_size=4"],
                         capture_output=True, text=True, cwd=elsewhere, env=environ, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len((elsewhere / "run" / "metrics.jsonl").read_text().splitlines()) == 2


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject.toml lists the packages by hand (find cannot add the mapped conf/ and recipes/):
    a subpackage missing there would be missing from every wheel, silently."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "parallel3d").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
