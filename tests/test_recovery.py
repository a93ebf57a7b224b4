"""Crash recovery: kill or hang a rank of a real torchrun job; it must resume and train as if nothing happened.

Faults come from outside, as they do in production: the test finds torchrun's worker processes under
/proc, sends one of them SIGKILL (a crash) or SIGSTOP (a hang), and judges the job by what it wrote:
metrics.jsonl and the checkpoints folder. Each trial's rank and step come from a seeded
``random.Random`` and are printed (``pytest -s``), so a failing trial can be replayed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness.runs import Run, env
from harness.shared_runs import shared_runs
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from parallel3d.checkpoint.commit import COMPLETE, META, complete_steps
from parallel3d.launch.run import pin_run_dir, restart_env

STEPS, EVERY = 24, 4
# Small steps (256 tokens), so that a trial's restarts, not its training, are what it costs.
RUN = [f"train.steps={STEPS}", "optim.warmup_steps=2", "train.seq_len=32", "train.global_batch_size=8",
       f"checkpoint.every={EVERY}"]
LAYOUTS = {"dp2": (2, ["parallel.dp_shard=2"]),  # name: (ranks, overrides)
           "dp2_pp2": (4, ["parallel.dp_shard=2", "parallel.pp=2"])}
# The uninterrupted references, trained in launches shared with other files' runs of these rank
# counts (tests/harness/shared_runs.py).
SHARED = {layout: (nproc, [*RUN, *overrides]) for layout, (nproc, overrides) in LAYOUTS.items()}
# Trials are random but repeatable: P3D_RECOVERY_SEED=N pytest ... explores other ranks and steps.
SEED = int(os.environ.get("P3D_RECOVERY_SEED", "0"))
JOB_TIMEOUT_S = 240
TORCHRUN_TEARDOWN_S = 30  # LocalElasticAgent._shutdown: SIGTERM, then SIGKILL this much later


def trial_rng(name: str) -> random.Random:
    print(f"P3D_RECOVERY_SEED={SEED}", flush=True)
    return random.Random(f"{SEED}/{name}")


# -- a torchrun job the test can watch, hurt, and always clean up ----------------------------------

def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(child) for child in task.read_text().split()]
        except OSError:  # the thread ended while we looked
            pass
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[19])


def _rank(pid: int) -> int | None:
    """RANK from the process's environment: torchrun sets it for its workers only."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(item[5:]) for item in environ if item.startswith(b"RANK=")), None)


def _alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


class Job:
    """``torchrun`` (or ``parallel3d-run``) in a session of its own, its output in a log file."""

    def __init__(self, cwd: Path, layout: str, args: Sequence[str] = (), run_dir: Path | None = None,
                 launcher: str = "torchrun", max_restarts: int = 3):
        self.nproc, overrides = LAYOUTS[layout]
        args = [*RUN, *overrides, *args, *([f"run_dir={run_dir}"] if run_dir else [])]
        module = "torch.distributed.run" if launcher == "torchrun" else "parallel3d.launch.run"
        cmd = [sys.executable, "-m", module, "--standalone", f"--nproc-per-node={self.nproc}",
               f"--max-restarts={max_restarts}"]
        cmd += ["-m", "parallel3d.train", *args] if launcher == "torchrun" else args
        environ = env()
        if launcher == "torchrun":  # what plain torchrun needs for restarts; parallel3d-run sets it itself
            environ.update(restart_env([f"--max-restarts={max_restarts}"]))
        cwd.mkdir(parents=True, exist_ok=True)
        self.log_path = cwd / "job.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.cwd, self.max_step, self._run_dir = cwd, 0, run_dir
        self.started: dict[int, int] = {}  # pid -> start time of every worker seen, for close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_running(self, deadline: float, waiting_for: str) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"job ended (rc={self.proc.returncode}) waiting for {waiting_for}\n"
                                 f"{self.log()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {waiting_for}\n{self.log()[-4000:]}")

    @property
    def run_dir(self) -> Path:
        """The run_dir given, or the one Hydra made under outputs/ once rank 0 has written to it."""
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while self._run_dir is None:
            found = [p.parent for p in self.cwd.glob("outputs/*/*/config.yaml")]
            if found:
                self._run_dir = found[0]
            else:
                self.check_running(deadline, "the run dir")
                time.sleep(0.05)
        return self._run_dir

    def last_step(self) -> int:
        """The last step in metrics.jsonl now; ``max_step``, the highest any attempt has logged."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return 0
        for line in reversed(lines):
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError):  # a line being written
                continue
            self.max_step = max(self.max_step, step)
            return step
        return 0

    def wait_for_step(self, step: int) -> None:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while self.last_step() < step:
            self.check_running(deadline, f"step {step}")
            time.sleep(0.005)

    def workers(self) -> dict[int, int]:
        """rank -> pid of the live workers of the current attempt."""
        found = {}
        for pid in _children(self.proc.pid):
            rank, stat = _rank(pid), _stat(pid)
            if rank is not None and stat is not None and stat[0] not in "ZX":
                found[rank] = pid
                self.started.setdefault(pid, stat[1])
        return found

    def pid(self, rank: int) -> int:
        deadline = time.monotonic() + 30
        while rank not in (workers := self.workers()):
            self.check_running(deadline, f"rank {rank}")
            time.sleep(0.01)
        return workers[rank]

    def newest_checkpoint(self) -> int:
        return max(complete_steps(self.run_dir / "checkpoints"), default=0)

    def wait(self) -> Run:
        try:
            self.proc.wait(JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job still running after {JOB_TIMEOUT_S} s\n{self.log()[-4000:]}") from None
        return Run(self.run_dir, self.proc.returncode, self.log(), self.log())  # one log for both streams

    def close(self) -> None:
        """Kill whatever is left. Workers run in sessions of their own (torchrun's choice), so killing
        the agent's group leaves them running: note them, stop the agent spawning more, kill them."""
        if self.proc.poll() is None:
            self.workers()
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid, started in self.started.items():
            stat = _stat(pid)
            if stat is not None and stat[1] == started:  # still that worker, not a reused pid
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def jobs():
    started = []

    def start(*args, **kwargs) -> Job:
        started.append(Job(*args, **kwargs))
        return started[-1]

    yield start
    for job in started:
        job.close()


@pytest.fixture(scope="module")
def reference(run_store, request):
    """The uninterrupted run of a layout, which every trial at that layout must reproduce (run once,
    read-only: a trial compares with its folder)."""
    runs = shared_runs(run_store, request.session, request.module)

    def get(layout: str) -> Run:
        runs[layout].assert_finished(STEPS)
        return runs[layout]

    return get


# -- judging a job --------------------------------------------------------------------------------

def assert_recovered(run: Run, reference: Run, trials: list[Trial]) -> None:
    """Finished after one restart per trial, each resuming from the newest complete checkpoint at its
    kill (or a newer one), with the reference's losses and checkpoints."""
    assert run.returncode == 0, run.stderr[-4000:]
    assert [r["step"] for r in run.metrics] == list(range(1, STEPS + 1))
    assert run.losses == reference.losses, (run.losses, reference.losses)  # the same layout: bit for bit
    found = attempts(run.stdout)
    assert len(found) == len(trials) + 1, run.stdout[-4000:]  # equal losses alone: a fresh start would do
    for trial, (_, logged), (resumed, _) in zip(trials, found, found[1:]):
        assert resumed % EVERY == 0 and trial.newest <= resumed <= logged, (trial, found)
    assert_checkpoints_sound(run.run_dir / "checkpoints", reference.run_dir / "checkpoints")


def attempts(log: str) -> list[tuple[int, int]]:
    """(step resumed from, last step logged) of each attempt, from rank 0's console lines."""
    found, resumed = [], 0
    for line in log.splitlines():
        if m := re.match(r"parallel3d: resumed from .*step_(\d+) \(saved at", line):
            resumed = int(m.group(1))
        elif line.startswith("parallel3d | "):  # the start-up line, printed after the resume
            found.append([resumed, resumed])
        elif m := re.match(r"\[ *(\d+)/\d+\] loss", line):
            found[-1][1] = int(m.group(1))
    return [tuple(a) for a in found]


def assert_checkpoints_sound(root: Path, reference_root: Path) -> None:
    """No partial folder left; every checkpoint complete, readable, and equal to the reference's."""
    folders = sorted(p.name for p in root.iterdir())
    steps = complete_steps(root)
    assert folders == sorted(f"step_{s}" for s in steps), f"incomplete checkpoints left: {folders}"
    assert steps == complete_steps(reference_root) and steps[-1] == STEPS
    for step in steps:
        path, expected = root / f"step_{step}", reference_root / f"step_{step}"
        assert json.loads((path / META).read_text())["step"] == step
        assert HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
        files = sorted(p.relative_to(path) for p in path.rglob("*.safetensors"))
        assert files == sorted(p.relative_to(expected) for p in expected.rglob("*.safetensors"))
        for name in files:  # reads every byte: a truncated or torn file fails here
            tensors = load_file(path / name)
            if name.parts[0] != "rng":  # RNG states differ between two uninterrupted runs too
                # the same layout: the same operations in the same order, bit for bit
                torch.testing.assert_close(tensors, load_file(expected / name), rtol=0, atol=0)


# -- faults ---------------------------------------------------------------------------------------

@dataclass
class Trial:
    rank: int
    step: int  # killed after this step was logged, or in its save
    newest: int = 0  # the newest complete checkpoint just before the kill
    caught_save: bool = False  # the step_<N> folder was incomplete when the kill landed


def _kill(job: Job, trial: Trial, pid: int) -> None:
    trial.newest = job.newest_checkpoint()
    os.kill(pid, signal.SIGKILL)
    job.last_step()  # the next trial picks a step past this one and the one in flight


def kill_during_training(job: Job, rng: random.Random) -> Trial:
    """SIGKILL a random rank somewhere in a random step after any step logged so far and after the
    first checkpoint (a kill before it restarts from scratch: no resume to test)."""
    trial = Trial(rank=rng.randrange(job.nproc), step=max(job.max_step + 2, EVERY + 1) + rng.randint(0, 4))
    delay = rng.uniform(0.0, 0.2)  # about one step: the kill lands anywhere in the step after
    print(f"kill rank {trial.rank} after step {trial.step} (+{delay:.3f} s)", flush=True)
    job.wait_for_step(trial.step)
    time.sleep(delay)
    _kill(job, trial, job.pid(trial.rank))
    return trial


def kill_during_save(job: Job, rng: random.Random) -> Trial:
    """SIGKILL a random rank as soon as a checkpoint folder exists without its COMPLETE marker."""
    step = (job.max_step // EVERY + rng.randint(1, 2)) * EVERY
    if step - job.max_step < 2:  # a save the previous attempt may have started: not a fresh one
        step += EVERY
    trial = Trial(rank=rng.randrange(job.nproc), step=step)
    print(f"kill rank {trial.rank} during the save of step {step}", flush=True)
    job.wait_for_step(step - 1)
    pid = job.pid(trial.rank)  # looked up before: the kill must follow the folder within a millisecond
    path = job.run_dir / "checkpoints" / f"step_{step}"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not path.is_dir():
        job.check_running(deadline, f"the save of step {step}")
        time.sleep(0.001)
    _kill(job, trial, pid)
    trial.caught_save = not (path / COMPLETE).exists()  # written last: absent now, absent at the kill
    print(f"  save in progress at the kill: {trial.caught_save}", flush=True)
    return trial


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.multirank
def test_killed_ranks_resume_from_the_newest_checkpoint(tmp_path, jobs, reference):
    """Three crashes at random ranks and steps, through parallel3d-run with no run_dir: the restarted
    workers compose their config again and must still find the first attempt's run dir."""
    rng = trial_rng("training")
    job = jobs(tmp_path, "dp2", launcher="parallel3d-run", max_restarts=3)
    trials = [kill_during_training(job, rng) for _ in range(3)]
    run = job.wait()
    assert_recovered(run, reference("dp2"), trials)
    assert list(tmp_path.glob("outputs/*/*")) == [run.run_dir]  # one folder for every attempt


@pytest.mark.multirank
def test_kills_during_a_save_leave_no_corrupt_checkpoint(tmp_path, jobs, reference):
    """Any of four ranks (two pipeline stages, each FSDP over two) killed while a checkpoint is written."""
    rng = trial_rng("save")
    job = jobs(tmp_path, "dp2_pp2", run_dir=tmp_path / "run", max_restarts=2)
    trials = [kill_during_save(job, rng) for _ in range(2)]
    run = job.wait()
    assert any(t.caught_save for t in trials), "no kill landed inside a save: the test proved nothing"
    assert_recovered(run, reference("dp2_pp2"), trials)


@pytest.mark.multirank
def test_a_hung_rank_fails_its_peers_within_the_timeout(tmp_path, jobs, reference):
    """SIGSTOP one rank: the others' next collective fails after train.dist_timeout_s, torchrun stops
    the group (the stopped rank cannot act on SIGTERM: SIGKILL follows TORCHRUN_TEARDOWN_S later)
    and restarts it."""
    timeout_s, rng = 10, trial_rng("hang")
    job = jobs(tmp_path, "dp2", [f"train.dist_timeout_s={timeout_s}"], run_dir=tmp_path / "run", max_restarts=1)
    trial = Trial(rank=rng.randrange(job.nproc), step=rng.randint(EVERY + 1, STEPS - 6))
    print(f"stop rank {trial.rank} after step {trial.step}", flush=True)
    job.wait_for_step(trial.step)
    peers = [job.pid(r) for r in range(job.nproc) if r != trial.rank]
    trial.newest, stopped = job.newest_checkpoint(), job.pid(trial.rank)
    os.kill(stopped, signal.SIGSTOP)
    hung_at = time.monotonic()
    while any(_alive(pid) for pid in peers):
        # A bound against a hang, not a speed claim: gloo's message below says the timeout fired, and
        # how soon it does is tools/bench_timeouts.py's (BENCHMARKS (o)).
        assert time.monotonic() - hung_at < JOB_TIMEOUT_S, f"peers of the stopped rank still waiting\n{job.log()}"
        time.sleep(0.05)
    failed_after = time.monotonic() - hung_at
    print(f"peers failed {failed_after:.1f} s after the stop", flush=True)
    assert f"Timed out waiting {timeout_s * 1000}ms" in job.log(), job.log()[-4000:]  # gloo's own timeout
    assert failed_after > timeout_s / 2
    while _alive(stopped):  # torchrun's SIGTERM stays pending on a stopped process; its SIGKILL does not
        assert time.monotonic() - hung_at < failed_after + TORCHRUN_TEARDOWN_S + JOB_TIMEOUT_S, "left hanging"
        time.sleep(0.1)
    print(f"stopped rank killed {time.monotonic() - hung_at:.1f} s after the stop", flush=True)
    assert_recovered(job.wait(), reference("dp2"), [trial])


def test_launcher_pins_hydra_run_dir_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (pinned,) = pin_run_dir([])
    match = re.fullmatch(r"hydra\.run\.dir=\$\{p3d\.rank0_dir:'(.*)'\}", pinned)
    assert match and re.fullmatch(rf"{re.escape(str(tmp_path))}/outputs/\d{{4}}-\d\d-\d\d/\d\d-\d\d-\d\d",
                                  match.group(1)), pinned
    # A user's own ${now:...} is resolved too; an explicit run_dir needs nothing.
    steps, pinned = pin_run_dir(["hydra.run.dir=mine/${now:%H-%M-%S}", "train.steps=3"])
    assert steps == "train.steps=3" and re.fullmatch(rf".*:'{re.escape(str(tmp_path))}/mine/\d\d-\d\d-\d\d'\}}", pinned)
    assert pin_run_dir(["run_dir=here", "hydra.run.dir=x/${now:%S}"]) == ["run_dir=here", "hydra.run.dir=x/${now:%S}"]


def test_launcher_unshares_torchruns_store_for_restarts():
    assert restart_env(["--nproc-per-node=2", "--max-restarts=3"]) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert restart_env(["--nproc-per-node=2"]) == {}
