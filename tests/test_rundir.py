"""Run directories: the run_dir= parse, the lock, a fresh start moving an old run aside."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from harness.runs import FAST, env

from parallel3d.runtime.rundir import (RunDirError, RunLock, agree_on_run_dir, given_run_dir, move_earlier_run_aside,
                                       own_run_dir, release_run_dir, run_dir_override, unwritable_run_dir)


def test_run_dir_parse_is_shared_by_the_launchers(tmp_path):
    assert given_run_dir(["a=1", "run_dir=x", "+run_dir=y"]) == "y"
    assert given_run_dir(["train.steps=2"]) is None
    assert given_run_dir(['run_dir="/tmp/a b"']) == given_run_dir(["run_dir='/tmp/a b'"]) == "/tmp/a b"
    assert given_run_dir(["run_dir=${oc.env:RUNS}/x"]) == "${oc.env:RUNS}/x"
    assert run_dir_override(tmp_path / "it's") == f"hydra.run.dir=${{p3d.rank0_dir:'{tmp_path}/it\\'s'}}"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    tree = ast.parse(path.read_text())
    names = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    return names | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


@pytest.mark.fast
def test_nothing_in_launch_imports_train_and_train_imports_no_launcher():
    package = Path(__file__).resolve().parent.parent / "parallel3d"
    for path in (package / "launch").glob("*.py"):
        assert "parallel3d.train" not in imported_modules(path), path
    assert not any(m.startswith("parallel3d.launch") for m in imported_modules(package / "train.py"))


@pytest.mark.fast
def test_a_second_live_run_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
        with pytest.raises(RunDirError, match=f"in use by the run of pid {holder.pid} on {socket.gethostname()}"):
            own_run_dir(tmp_path, fresh_start=False)
    finally:
        holder.kill()
        holder.wait()
    lock = own_run_dir(tmp_path, fresh_start=False)  # its process is gone now: stale
    assert f"took over the stale lock {tmp_path / '.lock'} (pid {holder.pid}" in capsys.readouterr().err
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    release_run_dir(tmp_path)
    assert not (tmp_path / ".lock").exists() and lock.path == tmp_path / ".lock"


def test_a_lock_held_on_another_host_is_never_taken_over(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"host": "node-elsewhere", "pid": 1}))
    with pytest.raises(RunDirError, match="pid 1 on node-elsewhere.*delete"):
        RunLock(tmp_path).acquire()


def test_resume_none_moves_the_earlier_run_aside(tmp_path, capsys):
    (tmp_path / "checkpoints" / "step_8").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "notes.txt").write_text("mine")  # not a run's file: stays
    own_run_dir(tmp_path, fresh_start=True)
    release_run_dir(tmp_path)
    (aside,) = tmp_path.glob("previous-*")
    assert f"moved the earlier run in {tmp_path} to {aside}" in capsys.readouterr().err
    assert (aside / "checkpoints" / "step_8").is_dir() and (aside / "metrics.jsonl").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", aside.name]
    assert move_earlier_run_aside(tmp_path) is None  # nothing left to move


def test_an_unwritable_run_dir_is_one_line_before_hydra(tmp_path):
    (tmp_path / "file").write_text("")
    problem = unwritable_run_dir(["train.py", f"run_dir={tmp_path / 'file' / 'run'}"])
    assert problem.startswith(f"run_dir={tmp_path / 'file' / 'run'} is not writable") and "Fix:" in problem
    assert unwritable_run_dir(["train.py", f"run_dir={tmp_path / 'ok'}"]) is None
    with pytest.raises(RunDirError, match="not writable"):
        agree_on_run_dir(str(tmp_path / "file" / "run"))


def test_a_quoted_run_dir_with_spaces_is_the_run_dir_and_nothing_else_is_made(tmp_path):
    run_dir = tmp_path / "a b"
    proc = subprocess.run([sys.executable, "-m", "parallel3d.train", f'run_dir="{run_dir}"', *FAST, "train.steps=1",
                           "optim.warmup_steps=1"], capture_output=True, text=True, timeout=300, env=env(),
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["a b"]  # no ./"/..."/ tree beside it
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1

