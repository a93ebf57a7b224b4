"""The sbatch script parallel3d-slurm writes (the real cluster test is in test_launch_multinode.py)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
from harness.runs import env

GPU_JOB = ["recipe=llama3_8b", "slurm.nodes=4", "slurm.partition=gpu", "slurm.account=proj42", "slurm.time=2-00:00:00",
           "+slurm.env.NCCL_DEBUG=WARN", "slurm.network_interface=ib0", "slurm.max_restarts=2",
           "slurm.setup=['module load cuda/12.4','source /opt/venv/bin/activate']",
           "slurm.srun_args=['--container-image=nvcr.io/nvidia/pytorch:25.01-py3']", "slurm.extra_sbatch=['--mem=0']"]


def slurm(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel3d.launch.slurm", *args], capture_output=True, text=True,
                          timeout=120, env=env(), cwd=cwd)


@pytest.fixture(scope="module")
def gpu_script(tmp_path_factory):
    """A 4-node x 8-GPU Llama 3 8B job, written but not submitted."""
    tmp = tmp_path_factory.mktemp("slurm")
    done = slurm(["--dry-run", f"run_dir={tmp / 'run'}", *GPU_JOB], cwd=tmp)
    assert done.returncode == 0, done.stderr
    return tmp, done.stdout, (tmp / "run" / "slurm" / "job.sbatch").read_text()


def sbatch_options(script: str) -> list[str]:
    return [line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH")]


@pytest.mark.fast
def test_script_asks_for_the_allocation(gpu_script):
    tmp, stdout, script = gpu_script
    assert script in stdout  # a dry run shows what it wrote
    log = tmp / "run" / "slurm" / "%j.out"
    assert sbatch_options(script) == [
        "--job-name=llama3_8b", "--nodes=4", "--ntasks-per-node=1", "--time=2-00:00:00", f"--output={log}",
        "--open-mode=append", f"--chdir={tmp}", "--gpus-per-node=8", "--partition=gpu",
        "--account=proj42", "--exclusive", "--requeue", "--signal=B:USR1@180", "--mem=0"]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)  # valid shell


def test_script_runs_one_torchrun_per_node_with_c10d_rendezvous(gpu_script):
    tmp, _, script = gpu_script
    lines = script.replace(" \\\n", " ").splitlines()  # the srun command spans lines for reading
    assert lines.index("module load cuda/12.4") < lines.index("source /opt/venv/bin/activate") < len(lines) - 3
    for exported in ("NCCL_SOCKET_IFNAME=ib0", "GLOO_SOCKET_IFNAME=ib0", "NCCL_DEBUG=WARN",
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "PYTHONUNBUFFERED=1"):
        assert f"export {exported}" in lines
    assert 'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in lines
    (command,) = [line for line in lines if line.startswith("srun ")]
    args = shlex.split(command.removesuffix(" &"))
    assert args[:4] == ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        "--container-image=nvcr.io/nvidia/pytorch:25.01-py3"]
    torchrun = args[4:args.index("parallel3d.train") + 1]
    assert torchrun == [sys.executable, "-m", "torch.distributed.run", "--nnodes=$SLURM_JOB_NUM_NODES",
                        "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=$head:29500",
                        "--rdzv-id=$SLURM_JOB_ID", "--max-restarts=2",
                        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "-m", "parallel3d.train"]
    overrides = args[len(torchrun) + 4:]
    assert overrides[:len(GPU_JOB)] == GPU_JOB  # quoted so that bash hands them over unchanged
    assert overrides[-1] == f"run_dir={tmp / 'run'}"  # fixed: a requeued job resumes in the same folder
    # The preemption signal reaches the batch shell only while it waits on a background srun.
    assert lines[-3:] == [command, "srun_pid=$!", "wait $srun_pid"] and command.endswith(" &")
    # ... and passes it on (torchrun forwards it to the ranks, which save), then requeues the job.
    (trap,) = [line for line in lines if line.startswith("trap ")]
    assert trap.endswith(" USR1") and trap.index('kill -USR1 "$srun_pid"') < trap.index("scontrol requeue")


@pytest.mark.parametrize("args, key", [
    (["slurm.gpus_per_node=0"], "slurm.nproc_per_node"),
    (["slurm.nodes=0"], "slurm.nodes"),
    (["slurm.time=forever"], "slurm.time"),
    (["slurm.nodes=2", "parallel.tp=3"], "parallel.dp_shard"),  # the training config, checked for 2 x 8 ranks
    (["slurm.gpus_per_node=0", "slurm.nproc_per_node=2", "train.device=cuda"], "train.device"),
    (["slurm.nodez=2"], "slurm.nodez"),
])
def test_bad_settings_fail_before_anything_is_written(tmp_path, args, key):
    done = slurm(["--dry-run", f"run_dir={tmp_path / 'run'}", *args], cwd=tmp_path)
    assert done.returncode == 2 and key in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_cpu_sweep_writes_one_job_per_combination(tmp_path):
    done = slurm(["--dry-run", "--multirun", f"run_dir={tmp_path / 'sweep'}", "slurm.gpus_per_node=0",
                  "slurm.nproc_per_node=4", "slurm.requeue=false", "optim.lr=1e-3,3e-3"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    jobs = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [(j["run_dir"], j["swept"]) for j in jobs] == [
        (str(tmp_path / "sweep" / "0"), "optim.lr=0.001"), (str(tmp_path / "sweep" / "1"), "optim.lr=0.003")]
    for job in jobs:
        script = (tmp_path / "sweep" / str(job["job"]) / "slurm" / "job.sbatch").read_text()
        assert not any(o.startswith("--gpus") or o in ("--requeue",) for o in sbatch_options(script))
        command = script.replace(" \\\n", " ").splitlines()[-1]
        assert "--nproc-per-node=4" in command and job["swept"] in command and not command.endswith("&")
        assert f"hydra.run.dir=${{p3d.rank0_dir:'{job['run_dir']}'}}" in shlex.split(command)
