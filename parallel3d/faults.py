"""What happens when a run goes wrong: one clear line on the console, the traceback in a log file,
and a stop on a signal that saves a checkpoint first.

Failures: ``report_failure`` writes the full traceback to ``run_dir/logs/rank<N>.log`` and prints
one line (rank 0, or the failing rank for a problem of its own). ``PARALLEL3D_DEBUG=1`` prints the
traceback on the console as well. Errors we can name (a corrupt file, an unwritable folder) are
``RunError``s whose message names the file and the fix.

Signals: ``StopSignals`` turns SIGTERM (preemption; what torchrun forwards to its workers) and
SIGUSR1 (Slurm's warning before the time limit, forwarded by the batch script) into "stop after
this step, with a checkpoint", and exits ``EXIT_REQUEUE``. The first Ctrl-C does the same and
says where the run is; a second one exits at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

DEBUG_ENV = "PARALLEL3D_DEBUG"
EXIT_FAILED = 1
EXIT_REQUEUE = 75  # EX_TEMPFAIL (sysexits.h): stopped on request with a checkpoint; start it again to resume
EXIT_INTERRUPTED = 130  # a second Ctrl-C: 128 + SIGINT, as a shell reports it


class RunError(RuntimeError):
    """A failure at run time that we can name: the message says which file and what to do."""


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def log_path(run_dir: str | os.PathLike | None, rank: int) -> Path:
    """``run_dir/logs/rank<N>.log``; a temporary folder's when run_dir cannot take it."""
    folders = ([Path(run_dir) / "logs"] if run_dir else []) + [Path(tempfile.gettempdir()) / "parallel3d-logs"]
    for folder in folders:
        path = folder / f"rank{rank}.log"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(path, "a"):
                return path
        except OSError:
            continue
    return Path(os.devnull)


def warnings_to_log(path: Path) -> None:
    """Send this process's Python warnings to ``path`` instead of the console. Ranks other than 0
    call it: a warning every rank raises is then printed once, by rank 0, and none is lost."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        with open(path, "a") as f:
            f.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line; named by its type unless it is one of ours."""
    text = " ".join(str(error).split())
    if isinstance(error, RunError) or type(error).__name__ in ("RunDirError", "ConfigError"):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def report_failure(error: BaseException, run_dir: str | None, rank: int) -> None:
    """Traceback to this rank's log file; one line to stderr (rank 0, or any rank for a RunError)."""
    path = log_path(run_dir, rank)
    with open(path, "a") as f:
        traceback.print_exception(error, file=f)
    if debug():
        traceback.print_exception(error, file=sys.stderr)
    if rank == 0 or isinstance(error, RunError):
        where = "" if rank == 0 else f"rank {rank}: "
        hint = "" if debug() else f"; {DEBUG_ENV}=1 prints it here"
        print(f"parallel3d: error: {where}{one_line(error)} (traceback in {path}{hint})", file=sys.stderr,
              flush=True)


def attempt_store(timeout):
    """The process group's store for this attempt of a ``torchrun --max-restarts`` job, or None.

    Since torch 2.5 torchrun's agent shares one TCPStore with every attempt's workers
    (TORCHELASTIC_USE_AGENT_STORE=True), and env:// puts each attempt's process-group keys under
    the same names: a restarted group reads its dead predecessor's addresses and fails
    ("Connection refused", pytorch#135712). A prefix per attempt (TORCHELASTIC_RESTART_COUNT, the
    same on every node: all agents restart together) gives each attempt keys of its own, so plain
    torchrun restarts need no TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"parallel3d/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


class Stopped(Exception):
    """Stopped on a signal after ``step``, with a checkpoint at ``checkpoint``."""

    def __init__(self, step: int, checkpoint: Path, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint}; "
                         f"exit {EXIT_REQUEUE}: start the same command again to resume")
        self.step, self.checkpoint = step, checkpoint


def last_checkpoint(checkpoints: Path) -> str:
    from parallel3d.checkpoint import complete_steps

    steps = complete_steps(checkpoints)
    return str(checkpoints / f"step_{steps[-1]}") if steps else "none yet"


class StopSignals:
    """Stop requests from signals, agreed by every rank at the same step.

    A handler only sets a flag; ``should_stop()`` (once per step) makes every rank see the same
    answer by one all_reduce of one int32 over a gloo group of its own (a CPU tensor, so it never
    waits for a GPU stream; not the checkpointer's group, whose asynchronous saves run collectives
    from a thread). With one process it is a flag read.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, checkpoints: Path, group=None, verbose: bool = True):
        self.checkpoints, self.group, self.verbose = checkpoints, group, verbose
        self.received: int | None = None
        self.step = 0  # the last finished step
        self._previous: dict[int, object] = {}

    @classmethod
    def for_run(cls, checkpoints: Path, verbose: bool, timeout) -> StopSignals:
        """Under several ranks, with the gloo group they agree over (every rank must call this)."""
        group = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        return cls(checkpoints, group, verbose)

    def install(self) -> StopSignals:
        import threading

        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt  # the second Ctrl-C: at once
        self.received = signum
        if self.verbose:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            again = "; Ctrl-C again to exit now" if signum == signal.SIGINT else ""
            print(f"\nparallel3d: {name} during step {self.step + 1} (last checkpoint: "
                  f"{last_checkpoint(self.checkpoints)}): stopping after this step with a checkpoint{again}",
                  file=sys.stderr, flush=True)

    def should_stop(self, step: int) -> bool:
        """Whether every rank stops after ``step`` (a collective under several ranks: all call it)."""
        self.step = step
        if self.group is None:
            return self.received is not None
        flag = torch.tensor([0 if self.received is None else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())


def check_corpus(corpus, seq_len: int, data_cfg) -> None:
    """Refuse token data too short for one sequence, naming the file. ``corpus``: a TokenFile, or
    the data.Corpus of several sources. (A vocabulary larger than the model's is refused before any
    process group, by validation: parallel3d/data/checks.py.)"""
    where = getattr(corpus, "path", None) or data_cfg.path or ", ".join(getattr(data_cfg, "sources", None) or [])
    sources = getattr(corpus, "sources", None)
    size = len(corpus) if sources is None else sum(len(a) for s in sources for a in s.arrays)
    if size < seq_len + 1:
        raise RunError(f"{where or 'the corpus'} holds {size} tokens, fewer than one sequence of "
                       f"train.seq_len={seq_len} needs ({seq_len + 1}). Fix: prepare more data "
                       f"(tools/prepare_data.py) or lower train.seq_len")


class SweepFailures:
    """Jobs of a one-process Hydra ``--multirun`` that failed. Each job's failure ends in
    SystemExit, which would end the whole sweep: here it is noted and the next job runs; the
    sweep reports them and exits 1 at the end. Outside a sweep a SystemExit passes unchanged."""

    def __init__(self):
        self.failed: list[tuple[int, int]] = []  # (job number, exit status)

    @contextlib.contextmanager
    def job(self):
        try:
            yield
        except SystemExit as e:
            number = _sweep_job_number()
            if number is None or not e.code:
                raise
            self.failed.append((number, e.code))
            print(f"parallel3d: sweep job {number} failed (exit {e.code}); going on with the next",
                  file=sys.stderr, flush=True)

    def exit_if_any(self) -> None:
        if self.failed:
            print(f"parallel3d: sweep jobs {[n for n, _ in self.failed]} failed", file=sys.stderr, flush=True)
            sys.exit(EXIT_FAILED)


def _sweep_job_number() -> int | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    config = HydraConfig.get() if HydraConfig.initialized() else None
    return config.job.num if config is not None and config.mode == RunMode.MULTIRUN else None
