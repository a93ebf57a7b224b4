"""A lighthouse and replica-group jobs on this machine, for tests/test_ft.py and tools/bench_ft.py:
each group a torchrun job in its own session (so a SIGKILL takes the whole group), its output in
files beside its run_dir, started again with the same command."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def child_env() -> dict:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="offline", HYDRA_FULL_ERROR="0")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHFT_LIGHTHOUSE"):
        e.pop(key, None)
    return e


class Job:
    """A process started in its own session; ``out``/``err``: its output files (appended to by restarts)."""

    def __init__(self, cmd: list[str], out: Path, cwd: Path):
        self.cmd, self.out, self.err, self.cwd = cmd, out.with_suffix(".out"), out.with_suffix(".err"), cwd
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def start(self) -> Job:
        self.started_at = time.time()
        with self.out.open("a") as out, self.err.open("a") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=err, env=child_env(), cwd=self.cwd,
                                         start_new_session=True)
        return self

    def kill(self) -> None:
        """SIGKILL to every process of the job: torchrun's agent and its ranks (which torchrun starts
        in sessions of their own), found before any dies."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def ranks(self) -> list[int]:
        """The pids of the job's ranks (the agent's children)."""
        return children(self.proc.pid)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.cmd[-1]}... still running after {timeout} s:\n{self.err.read_text()[-3000:]}")

    @property
    def stdout(self) -> str:
        return self.out.read_text() if self.out.exists() else ""

    @property
    def stderr(self) -> str:
        return self.err.read_text() if self.err.exists() else ""


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [d for child in found for d in descendants(child)]


def start_lighthouse(root: Path, *, port: int = 0, name: str = "lighthouse", min_replicas: int = 1) -> tuple[Job, str]:
    """parallel3d-lighthouse (quick to notice a dead group); returns the job and the address it printed."""
    job = Job([sys.executable, "-m", "parallel3d.cli.lighthouse", "--min-replicas", str(min_replicas),
               "--port", str(port),
               "--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "300", "--quorum-tick-ms", "20"],
              root / name, root).start()
    line = wait_for(lambda: next((l for l in job.stdout.splitlines() if "serving at" in l), None), 60,
                    lambda: f"no address from the lighthouse: {job.stderr[-2000:]}")
    return job, line.split("serving at ")[1].split()[0]


def group_job(root: Path, replica_id: int, overrides: list[str], *, nproc: int = 2, name: str | None = None) -> Job:
    name = name or f"group{replica_id}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "parallel3d.train", f"run_dir={root / name}", f"ft.replica_id={replica_id}", *overrides]
    return Job(cmd, root / name, root)


def membership(run_dir: Path) -> list[dict]:
    path = run_dir / "ft" / "membership.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(condition, timeout: float, explain=lambda: ""):
    """Poll ``condition`` until it returns something true; fail with ``explain()`` after ``timeout`` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s: {explain()}")
