"""parallel3d-slurm: a recipe plus ``slurm.*`` settings -> an sbatch script running ``srun torchrun``.

    parallel3d-slurm [--dry-run] [recipe=NAME] [key=value ...] slurm.nodes=4 slurm.partition=gpu
    parallel3d-slurm [--dry-run] --multirun [key=a,b ...]      # one job per sweep combination

The config is composed and validated here, for the job's world size (``slurm.nodes`` x ranks per
node), before anything is written or submitted. The script goes to ``run_dir/slurm/job.sbatch``
and its output to ``run_dir/slurm/<job id>.out``; without ``--dry-run`` it is submitted with
``sbatch`` and the job id is written to ``run_dir/slurm/job_id``.

One Slurm task per node runs torchrun, which starts that node's ranks and meets the other nodes
through a c10d rendezvous on the allocation's first node. The run_dir is fixed in the script, so
a requeued job (preemption, node failure, or the time limit: the script requeues itself
``slurm.requeue_grace_s`` before it) resumes from the newest complete checkpoint in it.

Why a script of our own and not submitit (or Hydra's submitit launcher): submitit pickles a
Python function and has Slurm start one copy of it per rank; torchrun would be bypassed, and with
it the elastic agent (worker restarts, rendezvous, failure detection) that multi-node training
relies on, and a job could not be read, edited or resubmitted without Python. What submitit would
save us is the sbatch text and the call to ``sbatch``, a few lines here.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from parallel3d.launch import sweep
from parallel3d.launch.run import EXIT_CONFIG_ERROR, exit_if_invalid, hydra_reason, hydra_run_dir, pin_run_dir
from parallel3d.runtime.rundir import given_run_dir

# torchrun's default set plus SIGUSR1, which it then passes on to its workers (it would die of it otherwise).
FORWARDED_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # sbatch --time: [D-]HH[:MM[:SS]] or minutes


def check_slurm(s) -> str | None:
    """What is wrong with the ``slurm`` settings, or None."""
    if s.nodes < 1:
        return f"slurm.nodes={s.nodes}: a job needs at least one node. Fix: set slurm.nodes=1 or more."
    if s.gpus_per_node < 0:
        return f"slurm.gpus_per_node={s.gpus_per_node}: cannot be negative. Fix: 0 for CPU nodes."
    if s.gpus_per_node == 0 and not s.nproc_per_node:
        return ("slurm.nproc_per_node=null: with slurm.gpus_per_node=0 (CPU nodes) the ranks per node are "
                "not implied. Fix: set slurm.nproc_per_node, e.g. slurm.nproc_per_node=8.")
    if s.nproc_per_node is not None and s.nproc_per_node < 1:
        return f"slurm.nproc_per_node={s.nproc_per_node}: must be 1 or more. Fix: set it to the ranks per node."
    if not TIME.match(str(s.time)):
        return f"slurm.time={s.time}: not a Slurm time. Fix: use HH:MM:SS or D-HH:MM:SS, e.g. slurm.time=1-00:00:00."
    return None


def ranks_per_node(s) -> int:
    return s.nproc_per_node or s.gpus_per_node


def render(s, overrides: list[str], run_dir: Path, job_name: str, workdir: Path) -> str:
    """The sbatch script: ``srun`` starts one torchrun per node, each runs its node's ranks."""
    log = run_dir / "slurm" / "%j.out"
    options = [f"--job-name={job_name}", f"--nodes={s.nodes}", "--ntasks-per-node=1", f"--time={s.time}",
               f"--output={log}", "--open-mode=append", f"--chdir={workdir}"]  # stderr goes to --output too
    options += [f"--gpus-per-node={s.gpus_per_node}"] * (s.gpus_per_node > 0)
    options += [f"--cpus-per-task={s.cpus_per_task}"] * bool(s.cpus_per_task)
    options += [f"--{key}={value}" for key, value in
                (("partition", s.partition), ("account", s.account), ("qos", s.qos)) if value]
    options += ["--exclusive"] * s.exclusive
    if s.requeue:
        options += ["--requeue", f"--signal=B:USR1@{s.requeue_grace_s}"]
    options += list(s.extra_sbatch)

    env = {"PYTHONUNBUFFERED": "1"}  # the log file shows each step as it happens
    if s.network_interface:
        env.update(NCCL_SOCKET_IFNAME=s.network_interface, GLOO_SOCKET_IFNAME=s.network_interface)
    if s.max_restarts:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # or restarts cannot connect (pytorch#135712)
    env.update(s.env)

    python = s.python or sys.executable
    torchrun = [python, "-m", "torch.distributed.run", "--nnodes=$SLURM_JOB_NUM_NODES",
                f"--nproc-per-node={ranks_per_node(s)}", "--rdzv-backend=c10d",
                f'--rdzv-endpoint="$head:{s.rdzv_port}"', '--rdzv-id="$SLURM_JOB_ID"',
                f"--max-restarts={s.max_restarts}", *([f"--signals-to-handle={FORWARDED_SIGNALS}"] * s.requeue),
                "-m", "parallel3d.train"]
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1", *map(shlex.quote, s.srun_args)]
    lines = ["#!/bin/bash", f"# Written by parallel3d-slurm for {run_dir}", *(f"#SBATCH {o}" for o in options), "",
             "set -eo pipefail", *s.setup, *(f"export {k}={shlex.quote(str(v))}" for k, v in env.items()), "",
             '# c10d rendezvous on the first node of the allocation',
             'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
             'echo "parallel3d: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, '
             'rendezvous $head"']
    if s.requeue:  # Slurm signals the batch shell only while it waits, so srun runs in the background
        # The chain (docs/troubleshooting.md): USR1 -> srun -> torchrun (--signals-to-handle) -> each
        # rank finishes its step and saves a checkpoint (exit 75); then the job requeues itself.
        lines += ['trap \'echo "parallel3d: time limit near: saving a checkpoint, then requeueing"; '
                  'kill -USR1 "$srun_pid"; wait "$srun_pid" || true; scontrol requeue "$SLURM_JOB_ID"\' USR1']
    command = " \\\n    ".join(" ".join(part) for part in (srun, torchrun, map(shlex.quote, overrides)))
    lines += (["", f"{command} &", "srun_pid=$!", "wait $srun_pid"] if s.requeue else ["", command])
    return "\n".join(lines) + "\n"


def script_for(overrides: list[str], run_dir: Path | None = None, *, workdir: Path | None = None) -> tuple[Path, str]:
    """Compose ``overrides`` once more for the settings; (where the script goes, its text).
    ``workdir`` (default: here) is where the job starts; docs/launch.md shows this function's text."""
    from parallel3d.config.compose import compose

    cfg = compose(overrides)
    run_dir = run_dir or Path(os.path.abspath(given_run_dir(overrides) or hydra_run_dir(overrides)))
    overrides = [o for o in overrides if sweep.key_of(o) != "run_dir"] + [f"run_dir={run_dir}"]
    job_name = cfg.slurm.job_name or cfg.recipe or "parallel3d"
    text = render(cfg.slurm, pin_run_dir(overrides), run_dir, job_name, workdir or Path.cwd())
    return run_dir / "slurm" / "job.sbatch", text


def prepare(overrides: list[str], run_dir: Path | None) -> tuple[Path, str]:
    """Write the script for ``overrides``; (script, text)."""
    script, text = script_for(overrides, run_dir)
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(text)
    return script, text


def submit(script: Path) -> str:
    """``sbatch`` the script; the job id."""
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed: {done.stderr.strip() or done.stdout.strip()}")
    job_id = done.stdout.strip().split(";")[0]  # --parsable: "<id>[;<cluster>]"
    (script.parent / "job_id").write_text(job_id + "\n")
    return job_id


def main(argv: list[str] | None = None) -> None:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from parallel3d.config.compose import compose

    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return
    dry_run = "--dry-run" in argv
    multirun = any(a in sweep.MULTIRUN_FLAGS for a in argv)
    overrides = [a for a in argv if a not in (*sweep.MULTIRUN_FLAGS, "--dry-run")]
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        print(f"parallel3d-slurm: unknown option {unknown[0]} (options: --dry-run, --multirun)", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    jobs = sweep.plan(overrides) if multirun else [sweep.Job(overrides, None, "")]
    for job in jobs:  # the Slurm settings decide the world size the training config must fit
        try:
            s = compose(job.overrides).slurm
        except (HydraException, OmegaConfBaseException) as e:  # a misspelled key, say: one line
            s, problem = None, hydra_reason(e)
        else:
            problem = check_slurm(s)
        if problem:
            print(f"parallel3d: config error: {problem}", file=sys.stderr)
            sys.exit(EXIT_CONFIG_ERROR)
        exit_if_invalid([job.overrides], [s.nodes * ranks_per_node(s)], [job.label] if multirun else None,
                        device="cuda" if s.gpus_per_node else "cpu")  # the nodes', not this login node's
    if multirun:
        print(f"parallel3d: sweep of {len(jobs)} jobs in {sweep.record(jobs)}")
    for job in jobs:
        script, text = prepare(job.overrides, job.run_dir)
        if dry_run:
            print(f"# {script}\n{text}")
            continue
        job_id = submit(script)
        print(f"parallel3d: submitted job {job_id}{' ' + job.label if multirun else ''}, "
              f"log {script.parent / (job_id + '.out')}")


if __name__ == "__main__":
    main()
