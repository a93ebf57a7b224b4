"""A built wheel, installed into a throwaway virtual environment (never the global one), runs
from any directory: conf/ and recipes/ ship inside the package, and so do the console scripts."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Installed:
    venv: Path
    elsewhere: Path  # a directory with no checkout in or above it
    environ: dict

    def run(self, command: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        """A console script (or ``python``) of the venv, from ``elsewhere``; fails the test on a non-zero exit."""
        done = subprocess.run([str(self.venv / "bin" / command), *args], capture_output=True, text=True,
                              cwd=self.elsewhere, env=self.environ, timeout=timeout)
        assert done.returncode == 0, f"{command} {' '.join(args)}: {done.stderr[-3000:]}"
        return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel in a venv on top of this interpreter's packages (torch is not installed again)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                               ".benchmarks", "outputs", "multirun"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True)
    (wheel,) = (tmp_path / "dist").glob("parallel3d-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # This interpreter's packages (torch, hydra ...) behind the venv's own, by a .pth file: under a
    # venv, --system-site-packages would reach the base interpreter's instead. Plain paths, so that
    # the .pth files there (an editable install of this checkout) stay out.
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    venv_site = subprocess.run([venv / "bin" / "python", "-c", purelib], capture_output=True, text=True,
                               check=True).stdout.strip()
    Path(venv_site, "parent_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # Without PYTHONPATH: a checkout on it would look installed already, and pip would skip the wheel.
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "-q",
                    str(wheel)], check=True, env=environ)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    environ.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", TQDM_DISABLE="1")
    return Installed(venv, elsewhere, environ)


def test_a_wheel_trains_from_another_directory_and_exports_the_checkpoint(installed):
    where = installed.run("python", "-c", "import parallel3d.config.compose as c; print(c.CONF_DIR); print(c.RECIPES_DIR)")
    assert all(Path(p).is_relative_to(installed.venv) for p in where.stdout.split()), where.stdout
    run_dir = installed.elsewhere / "run"
    installed.run("python", "-m", "parallel3d.train", "recipe=tiny_cpu", f"run_dir={run_dir}", "train.steps=2",
                  "optim.warmup_steps=1", "train.seq_len=32", "train.global_batch_size=4", "checkpoint.every=2")
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    installed.run("parallel3d-convert-hf", "export", str(run_dir), "hf", "--dtype", "float32")
    assert json.loads((installed.elsewhere / "hf" / "config.json").read_text())["model_type"] == "llama"
    assert (installed.elsewhere / "hf" / "model.safetensors").stat().st_size > 0


def test_every_console_script_runs_from_another_directory(installed):
    """Each script does real work (parallel3d-convert-hf in the test above); no --help rounds: each
    start of a script costs seconds of imports."""
    import tomllib

    here = installed.elsewhere
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])
    load_all = ("from importlib.metadata import entry_points; "  # every entry point resolves, in one start
                "print(*sorted(e.load() and e.name for e in entry_points(group='console_scripts') "
                "if e.name.startswith('parallel3d')))")
    assert set(installed.run("python", "-c", load_all).stdout.split()) == declared
    assert all((installed.venv / "bin" / script).is_file() for script in declared)
    plan = installed.run("parallel3d-plan", "recipe=tiny_cpu", "--world-size", "2")
    assert "bubble" in plan.stdout
    dry = installed.run("parallel3d-dry-run", "--world-size", "2", "recipe=tiny_cpu", "parallel.dp_shard=2")
    assert "memory per rank" in dry.stdout and "reduce_scatter" in dry.stdout
    (here / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(8)))
    installed.run("parallel3d-prepare-data", "--source", "docs.jsonl", "--cache-dir", "cache", "--workers", "1")
    assert list((here / "cache").rglob("*.bin")), "no token file written"
    (here / "plotted").mkdir()
    (here / "plotted" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 3.0 / s, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 100.0,
                    "step_time_s": 0.5}) + "\n" for s in (1, 2, 3)))
    installed.run("parallel3d-plot", "plotted", "--out", "plots", "--metrics", "loss")
    assert (here / "plots" / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert "-> 1.0000" in installed.run("parallel3d-report", "plotted").stdout


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch, capsys):
    import importlib.util

    from parallel3d import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.plot() == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert "pip install matplotlib" in line


def test_every_subpackage_is_listed_for_the_wheel():
    """pyproject.toml lists the packages by hand (find cannot add the mapped conf/ and recipes/):
    a subpackage missing there would be missing from every wheel, silently."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "parallel3d").rglob("__init__.py")}
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"
