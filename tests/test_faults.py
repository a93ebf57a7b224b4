"""The fault battery, end to end: real runs that hit one failure each and must say so in one line
(naming the file and the fix), keep the traceback in run_dir/logs, and lose nothing.

One 4-step run with checkpoints at steps 2 and 4 is trained once; each fault works on a copy.
Most faults fail before training starts, so the file stays fast.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.runs import FAST, Run, env, launch

from parallel3d.optim.schedule import lr_factor

BASE = [*FAST, "train.steps=4", "checkpoint.every=2"]


def assert_one_line_error(run, *needles: str) -> str:
    """The run failed with one parallel3d line naming ``needles``, no traceback on the console."""
    assert run.returncode != 0, run.stdout[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("parallel3d: error")]
    assert len(lines) == 1, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("faults") / "trained"
    launch(run_dir, BASE).assert_finished(4)
    return run_dir


def copy_of(trained: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir


def test_corrupt_newest_checkpoint_half_written_metrics_and_a_new_schedule(trained, tmp_path):
    """Auto-resume skips a truncated step_4 for step_2, saying so; a half-written last line of
    metrics.jsonl does not block it; the changed optim.lr and train.steps decide the learning rate
    from the next step on (a pure function of step and config), and the run prints what changed."""
    run_dir = copy_of(trained, tmp_path)
    shard = sorted((run_dir / "checkpoints" / "step_4").glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    lr = 1e-3
    run = launch(run_dir, [*FAST, "train.steps=6", "checkpoint.every=2", f"optim.lr={lr}"])
    run.assert_finished(6)
    assert f"skipping corrupt checkpoint {run_dir / 'checkpoints' / 'step_4'}" in run.stderr
    assert shard.name in run.stderr and "truncated" in run.stderr
    assert f"resumed from {run_dir / 'checkpoints' / 'step_2'}" in run.stdout
    assert "dropped unreadable line 5" in run.stderr
    changed = next(line for line in run.stdout.splitlines() if "changed config" in line)
    assert "optim.lr 0.003 -> 0.001" in changed and "train.steps 4 -> 6" in changed
    assert [row["step"] for row in run.metrics] == [1, 2, 3, 4, 5, 6]
    for row in run.metrics[2:]:  # LambdaLR counts from 0: step s runs at factor(s - 1)
        expected = lr * lr_factor(row["step"] - 1, steps=6, warmup=2, schedule="cosine", min_ratio=0.1,
                                  decay_fraction=0.2)
        assert row["lr"] == pytest.approx(expected, rel=1e-9), row


def test_checkpoint_past_train_steps_is_one_line_with_the_traceback_in_the_log(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    run = launch(run_dir, [*FAST, "train.steps=3"])
    line = assert_one_line_error(run, "step_4", "past train.steps=3", "Fix:")
    assert str(run_dir / "logs" / "rank0.log") in line
    assert "Traceback" in (run_dir / "logs" / "rank0.log").read_text()
    assert not (run_dir / ".lock").exists()  # released on failure too


def test_a_live_run_dir_is_refused_naming_its_holder(trained, tmp_path):
    run_dir = copy_of(trained, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        (run_dir / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
        run = launch(run_dir, [*FAST, "train.steps=6"])
    finally:
        holder.kill()
        holder.wait()
    assert_one_line_error(run, f"in use by the run of pid {holder.pid}", "Fix:")
    assert [row["step"] for row in run.metrics] == [1, 2, 3, 4]  # nothing written by the refused run


def test_vocabulary_larger_than_the_model_names_the_token_file(tmp_path):
    from parallel3d.data import write_token_file

    class WideTokenizer:  # ids up to 999 against model.vocab_size=512
        name, vocab_size, eos_id = "wide", 1000, 999

        def encode(self, text):
            return [ord(c) for c in text]

    path = write_token_file(["hello world " * 400], WideTokenizer(), tmp_path / "data" / "wide.bin")
    run = launch(tmp_path / "run", [*FAST, "data.source=file", f"data.path={path}"])
    # Refused by validation, before any process group: a config error naming the key and the file.
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.startswith("parallel3d: config error")]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    for needle in (f"data.path={path}", "vocabulary of 1000", "model.vocab_size >= 1000"):
        assert needle in lines[0], lines[0]


def test_an_unwritable_run_dir_is_one_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "a_file" / "run"
    proc = subprocess.run([sys.executable, "-m", "parallel3d.train", f"run_dir={run_dir}", *FAST],
                          capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=300)
    run = Run(run_dir, proc.returncode, proc.stdout, proc.stderr)
    assert_one_line_error(run, "not writable", "Fix: set run_dir=")


def terminate_after_two_steps(proc: subprocess.Popen, metrics: Path | str) -> str:
    """SIGTERM ``proc`` once its run has logged two steps (``metrics``: the file, or a glob under
    cwd for a run_dir Hydra names); its stderr after it exits."""
    deadline = time.monotonic() + 240

    def logged() -> int:
        found = [metrics] if isinstance(metrics, Path) else list(Path.cwd().glob(metrics))
        return max((len(m.read_text().splitlines()) for m in found if m.exists()), default=0)

    while logged() < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=120)[1]


def test_sigterm_finishes_the_step_saves_and_exits_for_a_requeue(tmp_path, monkeypatch):
    """Preemption: the step in flight completes, a checkpoint of it is written (checkpoint.every=0:
    none otherwise), exit 75, and one line says the command that resumes it: this run was given no
    run_dir (Hydra made outputs/DATE/TIME), so the same command would start afresh; the printed
    one, run as it is, resumes from that checkpoint and finishes the run."""
    monkeypatch.chdir(tmp_path)
    args = [*FAST, "train.steps=60"]
    proc = subprocess.Popen([sys.executable, "-m", "parallel3d.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(), cwd=tmp_path)
    err = terminate_after_two_steps(proc, "outputs/*/*/metrics.jsonl")
    assert proc.returncode == 75, err[-3000:]
    (run_dir,) = [p.resolve() for p in (tmp_path / "outputs").glob("*/*") if (p / "metrics.jsonl").is_file()]
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 2 <= last < 60
    checkpoint = run_dir / "checkpoints" / f"step_{last}"
    assert (checkpoint / "COMPLETE").is_file()
    (line,) = [x for x in err.splitlines() if x.startswith("parallel3d: stopped by SIGTERM")]
    assert line.startswith(f"parallel3d: stopped by SIGTERM after step {last}; checkpoint {checkpoint}; exit 75; "
                           f"resume with: ")
    command = line.split("resume with: ", 1)[1]
    assert command.endswith(f"{' '.join(args)} run_dir={run_dir}"), command
    assert "SIGTERM during step" in err and not (run_dir / ".lock").exists()
    resumed = subprocess.run(shlex.split(command), capture_output=True, text=True, env=env(), cwd=tmp_path,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint}" in resumed.stdout
    steps = [json.loads(row)["step"] for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 61))


def test_the_resume_command_names_the_launcher_and_the_run_dir(tmp_path, monkeypatch):
    """Under torchrun the command is its agent's (our parent process), options kept."""
    from parallel3d.runtime import signals

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    command = signals.resume_command(overrides=["train.steps=5", "run_dir=old", "data.sources=[a b.jsonl]"],
                                     run_dir=tmp_path / "run")
    assert shlex.split(command)[-3:] == ["train.steps=5", "data.sources=[a b.jsonl]", f"run_dir={tmp_path / 'run'}"]
    assert shlex.split(command)[1:3] == ["-m", "parallel3d.train"]
    agent = ["python", "-m", "torch.distributed.run", "--nproc-per-node=4", "-m", "parallel3d.train", "x=1"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setattr(signals, "parent_argv", lambda: agent)
    assert signals.launcher() == agent[:-1]
    monkeypatch.setattr(signals, "parent_argv", lambda: ["/venv/bin/python", "/venv/bin/torchrun", *agent[3:]])
    assert signals.launcher() == ["/venv/bin/torchrun", *agent[3:-1]]  # the entry point, not its interpreter


@pytest.mark.multirank
def test_sigterm_to_torchrun_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    """torchrun forwards SIGTERM to its workers; they agree on the step (one all_reduce per step)
    and save it (dp2: each rank writes its shards), then exit 75."""
    run_dir = tmp_path / "run"
    args = [*FAST, "train.steps=400", "parallel.dp_shard=2", f"run_dir={run_dir}"]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "-m", "parallel3d.train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(), cwd=tmp_path)
    metrics = run_dir / "metrics.jsonl"
    err = terminate_after_two_steps(proc, metrics)
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert (run_dir / "checkpoints" / f"step_{last}" / "COMPLETE").is_file(), err[-3000:]
    assert f"stopped by SIGTERM after step {last}" in err
    assert "exitcode  : 75" in err or "exitcode: 75" in err or "exit 75" in err
    # the command that resumes: torchrun's, as started, with the run's overrides and run_dir
    resume = (f"resume with: {sys.executable} -m torch.distributed.run --standalone --nproc-per-node=2 -m "
              f"parallel3d.train {' '.join(args[:-1])} run_dir={run_dir.resolve()}")
    assert resume in err, err[-3000:]


@pytest.mark.fast
def test_stop_signals_agree_ctrl_c_twice_exits_at_once(tmp_path, capsys):
    from parallel3d.runtime.signals import StopSignals

    (tmp_path / "checkpoints" / "step_3").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_3" / "COMPLETE").write_text("")
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; ignored in some test runners
    stop = StopSignals(tmp_path / "checkpoints").install()
    try:
        assert not stop.should_stop(4)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.should_stop(5)
        err = capsys.readouterr().err
        assert f"Ctrl-C during step 5 (last checkpoint: {tmp_path / 'checkpoints' / 'step_3'})" in err
        assert "Ctrl-C again to exit now" in err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before
    usr1 = StopSignals(tmp_path / "checkpoints").install()  # Slurm's warning, passed on by torchrun
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert usr1.should_stop(1) and usr1.received == signal.SIGUSR1
        assert "SIGUSR1 during step 1" in capsys.readouterr().err
    finally:
        usr1.restore()


def test_a_failure_is_one_line_and_the_debug_switch_prints_the_traceback(tmp_path, monkeypatch, capsys):
    from parallel3d.base import RunError
    from parallel3d.runtime.failures import report_failure

    def fail():
        raise RunError("data/x.bin is broken. Fix: write it again")

    for debug in ("", "1"):
        monkeypatch.setenv("PARALLEL3D_DEBUG", debug)
        try:
            fail()
        except RunError as e:
            report_failure(e, str(tmp_path), 0)
        err = capsys.readouterr().err
        assert err.count("parallel3d: error: data/x.bin is broken. Fix: write it again (traceback in "
                         f"{tmp_path / 'logs' / 'rank0.log'}") == 1
        assert ("Traceback" in err) == bool(debug)
    assert (tmp_path / "logs" / "rank0.log").read_text().count("Traceback") == 2


def test_plan_layout_gpu_memory_is_gib_without_a_unit():
    from parallel3d.cli.plan_layout import parse_bytes

    assert parse_bytes("80") == parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("1024B") == 1024


RESTART_PROBE = """
import os
from datetime import timedelta
import torch, torch.distributed as dist
from parallel3d.runtime.process_group import attempt_store
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
dist.init_process_group("gloo", store=attempt_store(timedelta(seconds=30)), rank=rank,
                        world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=30))
total = torch.ones(1)
dist.all_reduce(total)
if attempt == 0:  # the first attempt's group formed; rank 1 dies, torchrun restarts both
    dist.barrier()
    if rank == 1:
        os._exit(1)
    dist.barrier()
print(f"attempt {attempt} rank {rank} sum {total.item()}", flush=True)
dist.destroy_process_group()
os._exit(0)  # as parallel3d.train.main: gloo may abort in C++ static destructors, a failed attempt to torchrun
"""


@pytest.mark.multirank
def test_plain_torchrun_restarts_form_a_fresh_group(tmp_path):
    """pytorch#135712: without a store prefix per attempt, attempt 1 reads attempt 0's addresses
    from torchrun's shared store and gloo fails with "Connection refused" (measured with this probe
    and store=None). No TORCH_DISABLE_SHARE_RDZV_TCP_STORE in the environment."""
    (tmp_path / "probe.py").write_text(RESTART_PROBE)
    environ = {k: v for k, v in env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "--max-restarts=1", "probe.py"], capture_output=True, text=True, cwd=tmp_path,
                          env=environ, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    # two ranks share torchrun's stdout: a line of one may land inside the other's
    assert sorted(re.findall(r"attempt \d+ rank \d+ sum [\d.]+", done.stdout)) == [
        "attempt 1 rank 0 sum 2.0", "attempt 1 rank 1 sum 2.0"]


def test_a_hydra_multirun_goes_on_past_a_failed_job_and_reports_it(tmp_path):
    sweep = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "parallel3d.train", "--multirun", *FAST, "train.steps=2",
                           "optim.warmup_steps=1", "train.global_batch_size=15,16", f"hydra.sweep.dir={sweep}"],
                          capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "parallel3d: sweep job 0 failed (exit 2)" in done.stderr  # 15 sequences: not divisible
    assert done.stderr.rstrip().endswith("parallel3d: sweep jobs [0] failed")
    assert len((sweep / "1" / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_dry_run_tool_shows_its_progress_rank_by_rank(capsys):
    from parallel3d.cli import dry_run

    assert dry_run.main(["parallel.pp=2", "train.seq_len=32", "--world-size", "2"]) == 0
    err = capsys.readouterr().err
    assert "dry run: rank 0 (1 of 2)" in err and "dry run: rank 1 (2 of 2)" in err


def test_empty_or_truncated_token_data_is_named(tmp_path):
    from types import SimpleNamespace

    from parallel3d.base import RunError
    from parallel3d.data import ByteTokenizer, TokenFile, write_token_file
    from parallel3d.data.checks import check_corpus

    path = write_token_file(["tiny"], ByteTokenizer(), tmp_path / "tiny.bin")
    with pytest.raises(RunError, match=f"{path} holds 5 tokens, fewer than one sequence of train.seq_len=64"):
        check_corpus(TokenFile(path), 64, SimpleNamespace(path=str(path)))
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(RunError, match=f"{path} is 8 bytes but tiny.json says 10"):
        TokenFile(path)


def test_warnings_of_other_ranks_go_to_their_log_file(tmp_path, monkeypatch, capfd):
    """Python warnings, torch's logged warnings (a console handler of torch's own) and other loggers'."""
    import logging
    import warnings

    import torch  # noqa: F401  (registers torch's loggers and their console handlers)

    from parallel3d.runtime import failures

    # restored after the test
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(logging, "lastResort", logging.lastResort)
    monkeypatch.setattr(failures, "_log_file", None)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a worker's root logger has none (pytest's has)
    loggers = [x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)]
    handlers = [(h, h.stream) for x in loggers for h in x.handlers if type(h) is logging.StreamHandler]
    assert handlers, "torch no longer installs console handlers: drop that part of warnings_to_log"
    log = tmp_path / "rank1.log"
    try:
        for handler, _ in handlers:  # as in a worker process (torch was imported here under pytest's capture)
            handler.setStream(sys.stderr)
        failures.warnings_to_log(log)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("every rank says this")
        logging.getLogger("torch.distributed.tensor._collective_utils").warning("torch says this on every rank")
        logging.getLogger("some.library").warning("a library says this")
    finally:
        for handler, stream in handlers:
            handler.setStream(stream)
        failures._log_file.close()
    printed = capfd.readouterr()
    assert "says this" not in printed.err + printed.out
    text = log.read_text()
    assert "UserWarning: every rank says this" in text and "torch says this on every rank" in text
    assert "a library says this" in text


def test_a_run_that_stopped_on_purpose_is_not_retried_by_max_restarts(tmp_path, monkeypatch, capsys):
    """Exit 3 (a bad step that stops the run) noted by rank 0: the attempt torchrun --max-restarts
    starts after it exits 3 at once with the same line, without training; a new command runs."""
    from parallel3d import train as train_module
    from parallel3d.config.compose import compose
    from parallel3d.runtime.failures import RESTART_ENV, STOPPED_NOTE
    from parallel3d.runtime.guard import TrainingDiverged

    cfg = compose([f"run_dir={tmp_path}", *FAST])
    attempts = []

    def diverges(cfg):
        attempts.append(os.environ.get(RESTART_ENV))
        raise TrainingDiverged("3 bad steps in a row up to step 4 (loss nan)")

    monkeypatch.setattr(train_module, "train", diverges)
    monkeypatch.setattr(train_module, "command_line", lambda: [])
    for restart in ("0", "1", "2"):  # the first attempt, then torchrun's restarts
        monkeypatch.setenv(RESTART_ENV, restart)
        with pytest.raises(SystemExit) as stopped:
            train_module.run_job(cfg)
        assert stopped.value.code == 3
    assert attempts == ["0"]  # trained once
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "parallel3d: training stopped: 3 bad steps in a row up to step 4 (loss nan)"
    assert err[1:] == ["parallel3d: not restarted: the attempt before stopped on purpose (exit 3), and a restart "
                       "would stop the same way: training stopped: 3 bad steps in a row up to step 4 (loss nan)"] * 2
    monkeypatch.setenv(RESTART_ENV, "0")  # the same command again, by hand: it runs
    with pytest.raises(SystemExit):
        train_module.run_job(cfg)
    assert attempts == ["0", "0"] and (tmp_path / STOPPED_NOTE).is_file()
