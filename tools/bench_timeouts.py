#!/usr/bin/env python
"""How soon a run gets past what would otherwise stall it: the wall seconds the tests do not assert.

    python tools/bench_timeouts.py [--repeats 3] [--dist-timeout 10]

The tests prove what happens (tests/test_metrics.py: wandb falls back to offline with one line;
tests/test_watchdog.py, tests/test_recovery.py: a stopped rank's peers fail through
train.dist_timeout_s); how long it takes depends on the machine's load, so it is measured here:

- wandb online, server unreachable (a closed port on loopback): start_wandb until it returns;
- wandb online, a server that accepts and never answers, WANDB_INIT_TIMEOUT=3: the same;
- a 2-rank dp job with train.dist_timeout_s=N whose rank 1 is stopped (SIGSTOP) after step 3:
  seconds from the stop until rank 0 has exited.

Prints a Markdown block for BENCHMARKS.md (date, machine, command, medians over the repeats).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from bench_common import heading  # noqa: E402

from parallel3d.config.schema import WandbConfig  # noqa: E402
from parallel3d.observe.metrics import start_wandb  # noqa: E402


def wandb_seconds(*, silent_server: bool) -> float:
    """Seconds start_wandb(mode=online) takes to return (offline) against a dead or a silent server."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    port, stop, accepted = server.getsockname()[1], threading.Event(), []
    if silent_server:
        server.listen(16)
        server.settimeout(0.5)

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(server.accept()[0])
                except OSError:
                    continue

        threading.Thread(target=accept, daemon=True).start()
    else:
        server.close()  # nothing listens on the port
    os.environ.update(WANDB_BASE_URL=f"http://127.0.0.1:{port}", WANDB_API_KEY="x" * 40,
                      WANDB_INIT_TIMEOUT="3", WANDB_ERROR_REPORTING="false", WANDB_SILENT="true")
    os.environ.pop("WANDB_MODE", None)
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.monotonic()
        run = start_wandb(WandbConfig(enabled=True, mode="online"), Path(run_dir), {"a": 1})
        took = time.monotonic() - started
        run.finish()
    stop.set()
    for conn in accepted:
        conn.close()
    server.close()
    return took


def rank_pids(root_pid: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers under ``root_pid`` (processes whose environment has RANK)."""
    found, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                todo += [int(c) for c in task.read_text().split()]
            except OSError:
                pass
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
        if rank is not None and pid != root_pid:
            found[rank] = pid
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def hang_seconds(*, dist_timeout_s: int) -> float:
    """Seconds from SIGSTOP of rank 1 (after step 3) until rank 0 of a 2-rank job has exited."""
    with tempfile.TemporaryDirectory() as root:
        run_dir, env = Path(root) / "run", dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "parallel3d.train", f"run_dir={run_dir}", "train.steps=100000", "train.seq_len=32",
               "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.dp_shard=2",
               f"train.dist_timeout_s={dist_timeout_s}"]
        job = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
        try:
            metrics = run_dir / "metrics.jsonl"
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
                if job.poll() is not None:
                    raise SystemExit(f"the job ended before step 3 (rc={job.returncode}): {' '.join(cmd)}")
                time.sleep(0.05)
            workers = rank_pids(job.pid)
            os.kill(workers[1], signal.SIGSTOP)
            stopped = time.monotonic()
            while alive(workers[0]):
                time.sleep(0.05)
            return time.monotonic() - stopped
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def in_own_process(what: str) -> float:
    """One wandb measurement in a fresh process: wandb keeps one service per process, and a second
    start_wandb in the same one would reuse what the first left behind."""
    out = subprocess.run([sys.executable, __file__, "--only", what], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dist-timeout", type=int, default=10)
    parser.add_argument("--only", choices=["unreachable", "silent"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.only:
        print(wandb_seconds(silent_server=args.only == "silent"))
        return 0
    rows = {"wandb online, server unreachable": lambda: in_own_process("unreachable"),
            "wandb online, silent server, WANDB_INIT_TIMEOUT=3": lambda: in_own_process("silent"),
            f"stopped rank: its peer exits (train.dist_timeout_s={args.dist_timeout})":
                lambda: hang_seconds(dist_timeout_s=args.dist_timeout)}
    machine = f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} before"
    print(heading("Timeouts, wall seconds", "bench_timeouts.py", argv, machine) + "\n")
    print("| what | median s | all runs, s |\n|---|---|---|")
    for what, measure in rows.items():
        seconds = [measure() for _ in range(args.repeats)]
        print(f"| {what} | {statistics.median(seconds):.1f} | {', '.join(f'{s:.1f}' for s in seconds)} |", flush=True)
    print(f"\nLoad average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
