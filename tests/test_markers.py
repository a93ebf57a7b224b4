"""``-m "not multirank"`` starts no torchrun job: tests/conftest.py fails an unmarked test that tries."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import subprocess, sys
import pytest

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "no_such.py"]


def test_unmarked_starts_torchrun():
    subprocess.run(TORCHRUN, capture_output=True)


def test_unmarked_starts_python():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


@pytest.mark.multirank
def test_marked_starts_torchrun():
    subprocess.run(TORCHRUN, capture_output=True)
'''


def test_an_unmarked_test_that_starts_torchrun_fails_under_not_multirank(tmp_path):
    for harness in ("conftest.py", "parity_tolerance.py", "run_store.py"):  # conftest and the modules it imports
        shutil.copy(TESTS / harness, tmp_path / harness)
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    multirank: several ranks\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rA",
                           "-m", "not multirank", "test_sample.py"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    out = done.stdout
    assert "1 failed, 1 passed, 1 deselected" in out, out
    assert "FAILED test_sample.py::test_unmarked_starts_torchrun" in out and "not marked multirank" in out, out
