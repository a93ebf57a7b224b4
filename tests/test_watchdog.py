"""Hangs named (parallel3d/runtime/watchdog.py): a stopped rank is named, with the step, and every rank's
Python stack lands in run_dir/logs.

The end-to-end test SIGSTOPs rank 1 of a 2-rank torchrun job, as a frozen machine would be; rank 0's
collective times out after train.dist_timeout_s and its one line names rank 1. A stopped process
cannot dump its own stack, so the test lets it run again (SIGCONT) once rank 0 has gone: its
watchdog then sees its own freeze and dumps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.runs import env

from parallel3d.runtime.watchdog import Hang, hang_line

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from bench_timeouts import alive, rank_pids  # noqa: E402  (the benchmark's; one copy)

TIMEOUT_S = 10
HANG_S = 180  # against a hang: longer than any wait here takes, even on a loaded machine
STACKS = "Python stacks of every thread"


@pytest.mark.fast
def test_describe_names_silent_late_and_frozen_ranks():
    assert hang_line(Hang(7, "all_reduce called from parallel3d/runtime/guard.py:97 (update_allowed)", [1], {1: 6}), 0) == (
        "rank 1 (last seen at step 6) stopped answering (no heartbeat) while rank 0 waited at step 7 in all_reduce "
        "called from parallel3d/runtime/guard.py:97 (update_allowed)")
    assert hang_line(Hang(7, "", [], {0: 7, 1: 5, 2: 5}), 0).startswith("ranks 1, 2 are alive but still at step 5")
    assert "did not run for 12 s" in hang_line(Hang(7, "", [0], {}, frozen_s=12.3), 1)
    assert "every rank is alive at step 7" in hang_line(Hang(7, "", [], {0: 7, 1: 7}), 0)


def test_a_dead_peer_is_named_in_the_collective_that_failed_not_where_the_error_is_handled(tmp_path):
    """A peer that died fails the collective at once, before the watchdog fired: the diagnosis then
    names the collective the error was raised in (its traceback), not run_job, which handles it."""
    import torch.distributed as dist

    from parallel3d.runtime import watchdog

    code = {}  # frames that look like torch's collective and our caller
    exec(compile("import torch.distributed as dist\ndef all_reduce():\n    raise dist.DistError('Connection closed "
                 "by peer')\n", "/site-packages/torch/distributed/distributed_c10d.py", "exec"), code)
    exec(compile("def update_allowed(all_reduce):\n    all_reduce()\n", "/repo/parallel3d/runtime/guard.py", "exec"),
         code)
    store = dist.HashStore()
    store.set(f"{watchdog.KEY}0", "5 7")  # rank 1 never beats again: dead
    watchdog._current = watchdog.Watchdog(store=store, rank=0, world_size=2, timeout_s=2, log_path=tmp_path / "r0.log")
    try:
        try:
            code["update_allowed"](code["all_reduce"])
        except dist.DistError as e:
            line = str(watchdog.explain(e))
    finally:
        watchdog._current = None
    assert "rank 1 stopped answering (no heartbeat) while rank 0 waited at step 0 in all_reduce called from " \
           "parallel3d/runtime/guard.py:2 (update_allowed): a collective failed" in line, line
    assert "run_job" not in line and "test_watchdog" not in line


def _wait(condition, timeout_s: float, what: str, log: Path) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"timed out waiting for {what}\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_stopped_rank_is_named_and_every_stack_is_logged(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "parallel3d.train", f"run_dir={run_dir}", "train.steps=100000", "train.seq_len=32",
           "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.dp_shard=2",
           f"train.dist_timeout_s={TIMEOUT_S}"]
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, HANG_S, "step 3", log)
        workers = rank_pids(job.pid)
        os.kill(workers[1], signal.SIGSTOP)
        stopped_after = json.loads(metrics.read_text().splitlines()[-1])["step"]
        # A bound against a hang, not a speed claim (that is tools/bench_timeouts.py's): the line
        # checked below names train.dist_timeout_s, so the timeout is what ended rank 0's wait.
        _wait(lambda: not alive(workers[0]), HANG_S, "rank 0 to give up", log)
        os.kill(workers[1], signal.SIGCONT)  # as a frozen machine that comes back: now it can dump
        _wait(lambda: job.poll() is not None, HANG_S, "torchrun to end", log)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    console = log.read_text()
    lines = [line for line in console.splitlines() if line.startswith("parallel3d: error")]
    assert len(lines) == 1, console[-4000:]
    assert "rank 1 (last seen at step" in lines[0] and "stopped answering (no heartbeat) while rank 0 waited at step" \
        in lines[0], lines[0]
    step = int(lines[0].split("waited at step ")[1].split()[0])
    assert stopped_after <= step <= stopped_after + 2, (stopped_after, lines[0])
    assert " called from parallel3d/" in lines[0], lines[0]  # the collective it waited in, and our line under it
    assert f"train.dist_timeout_s={TIMEOUT_S}" in lines[0] and "rank<N>.log" in lines[0]
    for rank in (0, 1):
        text = (run_dir / "logs" / f"rank{rank}.log").read_text()
        dumped_at = [int(m) for m in re.findall(rf"parallel3d watchdog: rank {rank} at step (\d+)", text)]
        assert dumped_at and step - 1 <= dumped_at[0] <= step, f"rank {rank}:\n{text[-3000:]}"
        assert STACKS in text and "(most recent call first)" in text, f"rank {rank}:\n{text[-3000:]}"
    assert "did not run for" in (run_dir / "logs" / "rank1.log").read_text()
