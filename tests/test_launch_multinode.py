"""Training across "nodes": torchrun on two network namespaces, and a job on a real SLURM cluster.

The nodes are network namespaces on this machine (tests/harness/virtual_cluster.py): separate addresses
and hostnames, a shared filesystem. Each run must reproduce, step for step, the same layout under
plain single-node torchrun. Needs root (plus iproute2 and util-linux) and, for SLURM, the Debian
packages slurmctld slurmd slurm-client munge; otherwise the tests skip and say why.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
from harness.parity import PARITY_STEPS, SAVING
from harness.runs import Run, env
from harness.virtual_cluster import TERMINAL, Nodes, SlurmCluster, cluster_unavailable, nodes_unavailable

pytestmark = pytest.mark.multirank
NO_NODES, NO_CLUSTER = nodes_unavailable(), cluster_unavailable()
# 4 ranks: dp2 x tp2, so both kinds of collective cross the "network"; trained as tests/test_checkpoint.py's
# dp2 x tp2 run that saves (the session's run store trains that once for both files).
LAYOUT = [*SAVING, "parallel.dp_shard=2", "parallel.tp=2"]
TIMEOUT_S = 300  # a run takes ~30 s; under pytest's own 600 s per test, so our tear-down still runs


@pytest.fixture(scope="module")
def reference(run_store) -> Run:
    """The same layout under plain torchrun on one node."""
    run = Run.from_record(run_store.get({"dp2-tp2": (4, LAYOUT)})["dp2-tp2"])
    run.assert_finished(PARITY_STEPS)
    return run


def wait_all(procs: list[subprocess.Popen], timeout: float, grace: float = 60) -> list[int | None]:
    """Exit codes (None: still running, killed at tear-down). Once one node fails, the others get
    ``grace`` seconds: a node whose peer died may otherwise wait for it until the rendezvous times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        if any(p.poll() for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.5)
    return [proc.poll() for proc in procs]


@pytest.mark.skipif(NO_NODES is not None, reason=str(NO_NODES))
@pytest.mark.parametrize("rendezvous", ["c10d", "static"])
def test_torchrun_on_two_nodes(rendezvous, reference, tmp_path):
    run_dir = tmp_path / "run"
    rdzv = {"c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", "p3dn1:29500", "--rdzv-id", f"p3d{os.getpid()}"],
            "static": ["--master-addr", "p3dn1", "--master-port", "29500"]}[rendezvous]
    with Nodes(2) as nodes:
        procs = []
        for rank, name in enumerate(nodes.names):
            node_rank = ["--node-rank", str(rank)] if rendezvous == "static" else []
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   *node_rank, *rdzv, "-m", "parallel3d.train", f"run_dir={run_dir}", *LAYOUT]
            with open(tmp_path / f"{name}.log", "w") as log:
                procs.append(nodes.popen(name, cmd, env=env(), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT))
        codes = wait_all(procs, TIMEOUT_S)
    logs = "\n".join(f"--- {name}\n{(tmp_path / f'{name}.log').read_text()[-3000:]}" for name in nodes.names)
    run = Run(run_dir, 0, "", f"exit codes {codes}\n{logs}")
    run.assert_finished(PARITY_STEPS)  # 4 ranks at 2 per node: a finished run had both nodes in it
    assert run.losses == reference.losses  # the same layout: the same operations, bit for bit


SLURM = ["slurm.nodes=2", "slurm.gpus_per_node=0", "slurm.nproc_per_node=2", "slurm.network_interface=eth0",
         "+slurm.env.OMP_NUM_THREADS=1", "+slurm.env.WANDB_MODE=offline"]


def submit(cluster: SlurmCluster, run_dir, cwd, overrides: list[str]) -> str:
    """parallel3d-slurm on the login host, as a user would run it; the job id."""
    done = cluster.run([sys.executable, "-m", "parallel3d.launch.slurm", f"run_dir={run_dir}", *LAYOUT,
                        *SLURM, *overrides], env=env(), cwd=cwd, check=False, timeout=180)
    found = re.search(r"parallel3d: submitted job (\d+)", done.stdout)
    assert done.returncode == 0 and found, f"{done.stdout}\n{done.stderr}\n{cluster.logs()}"
    return found.group(1)


def report(cluster: SlurmCluster, run_dir, job_id: str, state: str) -> str:
    log = run_dir / "slurm" / f"{job_id}.out"
    return (f"job {job_id} ended {state}\n--- {log}\n{log.read_text()[-4000:] if log.exists() else '(none)'}\n"
            f"{cluster.logs()}")


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_slurm_job_on_two_nodes(reference, tmp_path):
    """parallel3d-slurm submits from the login host; srun starts one torchrun per node."""
    run_dir = tmp_path / "run"
    with SlurmCluster(2) as cluster:
        job_id = submit(cluster, run_dir, tmp_path, [])
        why = report(cluster, run_dir, job_id, cluster.wait_for_job(job_id, TIMEOUT_S))
    assert (run_dir / "slurm" / "job_id").read_text().strip() == job_id
    log = run_dir / "slurm" / f"{job_id}.out"
    assert log.exists(), why
    assert "on p3dn[1-2], rendezvous p3dn1" in log.read_text(), why
    # Judged by what the run wrote, not the job's state: gloo rarely aborts a worker at exit after a
    # finished run ("terminate called without an active exception" from a C++ static destructor,
    # see parallel3d/train.py main()), and the job would then end FAILED.
    run = Run(run_dir, 0, "", why)
    run.assert_finished(PARITY_STEPS)
    assert run.losses == reference.losses  # the same layout: the same operations, bit for bit


@pytest.mark.skipif(NO_CLUSTER is not None, reason=str(NO_CLUSTER))
def test_slurm_job_requeues_itself_before_its_time_limit_and_resumes(reference, tmp_path):
    """Slurm's warning signal (USR1, slurm.requeue_grace_s before the limit) makes the job requeue
    itself; the next attempt resumes from the newest checkpoint and ends with the same losses."""
    run_dir = tmp_path / "run"
    with SlurmCluster(2) as cluster:
        # A checkpoint every step (the numbers do not change): the signal comes after the first, with
        # the run's other steps still to go.
        job_id = submit(cluster, run_dir, tmp_path, ["checkpoint.every=1"])
        deadline = time.monotonic() + TIMEOUT_S
        while not (run_dir / "checkpoints" / "step_1" / "COMPLETE").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        cluster.run(["scancel", "--batch", "--signal=USR1", job_id])  # what Slurm sends near the limit
        while cluster.job_state(job_id) not in ("PENDING", *TERMINAL) and time.monotonic() < deadline:
            time.sleep(0.5)
        # Slurm holds a requeued job back for about two minutes (its BeginTime); not what is tested here.
        # Only once the nodes are done with the first attempt, and a second later: slurmd refuses a
        # credential issued in the second it revoked the job's old one ("Job credential revoked",
        # seen under load when the start came at once).
        cluster.wait_idle()
        time.sleep(2)
        cluster.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
        why = report(cluster, run_dir, job_id, cluster.wait_for_job(job_id, TIMEOUT_S))
    log = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert "parallel3d: time limit near: saving a checkpoint, then requeueing" in log, why
    assert f"job {job_id} (restart 1)" in log, why
    assert "resumed from" in log, why
    run = Run(run_dir, 0, "", why)
    run.assert_finished(PARITY_STEPS)
    assert run.losses == reference.losses  # the same layout: the same operations, bit for bit
