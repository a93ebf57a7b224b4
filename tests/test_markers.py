"""``-m "not multirank"`` starts no torchrun job and no rank processes: tests/process_guard.py fails an
unmarked test that tries (through torchrun, mp.spawn or multiprocessing), and lets one process be."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import multiprocessing, subprocess, sys, time
import pytest
import torch.multiprocessing as mp

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "no_such.py"]


def test_unmarked_starts_torchrun():
    subprocess.run(TORCHRUN, capture_output=True)


def test_unmarked_starts_python():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.multirank
def test_marked_starts_torchrun():
    subprocess.run(TORCHRUN, capture_output=True)


def _rank(rank, seconds=60):
    time.sleep(seconds)  # waiting for its peers, as a rank at its rendezvous does


def test_unmarked_starts_ranks_through_multiprocessing():
    ranks = [multiprocessing.get_context("fork").Process(target=_rank, args=(r,)) for r in range(2)]
    for rank in ranks:
        rank.start()


def test_unmarked_starts_ranks_through_mp_spawn():
    mp.start_processes(_rank, nprocs=2, start_method="fork")


def test_unmarked_forks_one_process():
    one = multiprocessing.get_context("fork").Process(target=_rank, args=(0, 0))
    one.start()
    one.join()
    assert one.exitcode == 0
'''


def test_an_unmarked_test_that_starts_torchrun_or_ranks_fails_under_not_multirank(tmp_path):
    for harness in ("conftest.py", "parity_tolerance.py", "process_guard.py"):  # conftest and what it imports
        shutil.copy(TESTS / harness, tmp_path / harness)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    multirank: several ranks\n")
    environ = {key: value for key, value in os.environ.items() if key != "P3D_TEST_CPU_LOG"}  # not the sample's
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rA",
                           "-m", "not multirank", "test_sample.py"], capture_output=True, text=True, cwd=tmp_path, env=environ,
                          timeout=120)
    out = done.stdout
    assert "3 failed, 2 passed, 1 deselected" in out, out
    for test in ("starts_torchrun", "starts_ranks_through_multiprocessing", "starts_ranks_through_mp_spawn"):
        assert f"FAILED test_sample.py::test_unmarked_{test}" in out, out
    assert "not marked multirank but starts torchrun" in out, out
    assert out.count("not marked multirank but starts rank processes") >= 2, out  # one per test, repeated by -rA


def test_no_test_skips_for_a_missing_dev_dependency():
    """pyproject's dev extra is what CI installs: a test that needs one of its packages imports it, so
    that a package missing fails the test instead of skipping it green (pytest.importorskip)."""
    project = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]
    dev = {re.split(r"[<>=!~\[ ;]", spec)[0].lower().replace("-", "_") for spec in project["optional-dependencies"]["dev"]}
    skipping = [f"{path.name}:{node.lineno} importorskip({node.args[0].value!r})"
                for path in sorted(TESTS.glob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value.split(".")[0] in dev]
    assert not skipping, f"a dev dependency is imported, not skipped for: {skipping}"
