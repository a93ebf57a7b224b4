#!/usr/bin/env python
"""Fault tolerance: how long a killed replica group takes to rejoin, and what the survivors lose.

    python tools/bench_ft.py [--cycles 3] [--nproc 2] [key=value ...]

One lighthouse and two replica groups of ``--nproc`` CPU ranks (the tiny model, dp_shard over the
group's ranks) train; each cycle SIGKILLs every process of group 1 once both groups have trained
three steps together, and starts it again at once with the same command. Per cycle, from the
groups' run_dir/ft/membership.jsonl and the heal line:

- start-up: the restart's process launch to its group being ready (imports, model, data);
- rejoin: ready to its first committed step (quorum, heal from the live peer, one step), the
  number the issue bounds (10 s);
- heal: copying the state from the peer (inside rejoin);
- survivors' lost steps: attempts group 0 had discarded (each a step trained again), and the
  gap between its last commit before the kill and its first one after (it notices the dead group
  after the lighthouse's heartbeat timeout, 1 s here).

Prints a Markdown block for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common import heading
from ft_cluster import group_job, membership, start_lighthouse, wait_for


def together(run_dir: Path, since: float) -> int:
    return sum(e["participants"] == [0, 1] and e["time"] > since for e in membership(run_dir))


def cycle(root: Path, g1, since: float) -> dict:
    """Kill group 1 once it has trained 3 steps with group 0 after ``since``; restart it; measure."""
    wait_for(lambda: together(root / "group1", since) >= 3, 600, lambda: g1.stderr[-2000:])
    g1.kill()
    killed = time.time()
    seen = len(g1.stdout)
    g1.start()
    launched = g1.started_at
    joined = wait_for(lambda: next((e for e in membership(root / "group1")
                                    if e["time"] > killed and e["joined_after_s"] is not None), None), 600,
                      lambda: g1.stderr[-2000:])
    heal = re.search(r"healed from replica group 0 at step \d+ in ([0-9.]+) s", g1.stdout[seen:])
    survivor = membership(root / "group0")
    before = max(e["time"] for e in survivor if e["time"] < killed)
    after = min(e["time"] for e in survivor if e["time"] > killed)
    lost = sum(e["discarded_attempts"] for e in survivor if killed < e["time"] <= joined["time"])
    return {"start-up s": joined["time"] - joined["joined_after_s"] - launched, "rejoin s": joined["joined_after_s"],
            "heal s": float(heal.group(1)) if heal else float("nan"), "survivor lost steps": lost,
            "survivor gap s": after - before, "done": joined["time"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks of each group")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as tmp:
        root = Path(tmp)
        lighthouse, address = start_lighthouse(root)
        common = ["train.steps=100000", "train.seq_len=64", "train.global_batch_size=16", "ft.enabled=true",
                  f"ft.lighthouse={address}", "ft.replicas=2", "ft.timeout_s=20", "ft.quorum_timeout_s=120",
                  "debug.ft_alone_sleep_s=0.5", *args.overrides]
        jobs = [lighthouse, group_job(root, 0, common, nproc=args.nproc).start(),
                group_job(root, 1, common, nproc=args.nproc).start()]
        try:
            rows, since = [], 0.0
            for _ in range(args.cycles):
                rows.append(cycle(root, jobs[2], since))
                since = rows[-1]["done"]
        finally:
            for job in jobs:
                job.kill()
    print(heading("Replica group kill and rejoin", "bench_ft.py", argv,
                  f"2 groups x {args.nproc} CPU ranks, tiny model") + "\n")
    keys = ["start-up s", "rejoin s", "heal s", "survivor lost steps", "survivor gap s"]
    print("| cycle | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
    for i, row in enumerate(rows, 1):
        cells = (f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in keys)
        print(f"| {i} | " + " | ".join(cells) + " |")
    print("| median | " + " | ".join(f"{statistics.median(r[k] for r in rows):.2f}" for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
