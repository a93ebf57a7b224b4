"""One clear line on the console for a failure, the traceback in a log file.

``report_failure`` writes the full traceback to ``run_dir/logs/rank<N>.log`` and prints one line
(rank 0, or the failing rank for a problem of its own). ``PARALLEL3D_DEBUG=1`` prints the
traceback on the console as well. Errors we can name (a corrupt file, an unwritable folder) are
``RunError``s (parallel3d/base.py) whose message names the file and the fix. ``SweepFailures``
keeps a one-process Hydra sweep going past a failed job and reports the failed ones at the end.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from parallel3d.base import RunError

DEBUG_ENV = "PARALLEL3D_DEBUG"
EXIT_FAILED = 1
EXIT_REQUEUE = 75  # EX_TEMPFAIL (sysexits.h): stopped on request with a checkpoint; start it again to resume
EXIT_INTERRUPTED = 130  # a second Ctrl-C: 128 + SIGINT, as a shell reports it


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def ensure_rank_log(run_dir: str | os.PathLike | None, rank: int) -> Path:
    """Create ``run_dir/logs/rank<N>.log`` (a temporary folder's when run_dir cannot take it);
    return its path."""
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
    """Send this process's warnings to ``path`` instead of the console. Ranks other than 0 call it:
    a warning every rank raises is then printed once, by rank 0, and none is lost.

    Two channels: Python's ``warnings`` (C++ TORCH_WARN arrives there too) and ``logging``, where
    torch's own warnings go (DTensor's "CPU process group does not support alltoall", its notes on
    sequential collectives): torch gives each logger it registers a console handler of its own,
    and records of unconfigured loggers reach logging's last resort, which prints to stderr."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        try:
            with open(path, "a") as f:
                f.write(warnings.formatwarning(message, category, filename, lineno, line))
        except OSError:  # a full disk: a warning lost, not a run
            pass

    warnings.showwarning = show
    _logging_to(path)


_log_file = None  # where _logging_to last pointed the console handlers (several runs in one process)


def _logging_to(path: Path) -> None:
    """Point every logging handler that writes to the console, and logging's last resort, at ``path``."""
    import logging

    global _log_file
    consoles = {id(s) for s in (sys.stderr, sys.__stderr__, sys.stdout, sys.__stdout__, _log_file) if s is not None}
    log_file = open(path, "a", buffering=1)
    loggers = [logging.getLogger(), *(x for x in logging.Logger.manager.loggerDict.values()
                                      if isinstance(x, logging.Logger))]
    for handler in (h for logger in loggers for h in logger.handlers):
        if type(handler) is logging.StreamHandler and id(handler.stream) in consoles:
            handler.setStream(log_file)
    logging.raiseExceptions = False  # a full disk: a record lost, no "--- Logging error ---" on the console
    logging.lastResort = logging.StreamHandler(log_file)
    logging.lastResort.setLevel(logging.WARNING)
    if _log_file is not None:
        _log_file.close()
    _log_file = log_file


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line; named by its type unless it is one of ours."""
    text = " ".join(str(error).split())
    if isinstance(error, RunError) or type(error).__name__ in ("RunDirError", "ConfigError"):
        return text
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = f" writing {error.filename}" if error.filename else ""
        return (f"disk full{where}: free space on its file system (run_dir's, or data.cache_dir's) and run again; "
                f"the last checkpoint is intact")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def report_failure(error: BaseException, run_dir: str | None, rank: int) -> None:
    """Traceback to this rank's log file; one line to stderr (rank 0, or any rank for a RunError)."""
    path, kept = ensure_rank_log(run_dir, rank), True
    try:  # on a full disk the log cannot take it: the one line still comes, and nothing after it
        with open(path, "a") as f:
            traceback.print_exception(error, file=f)
    except OSError as e:
        kept = f"{e.strerror or type(e).__name__}"
    if debug():
        traceback.print_exception(error, file=sys.stderr)
    # Rank 0 speaks for all; another rank only for a problem of its own (an error every rank
    # raised together, ``every_rank``, is said once).
    if rank == 0 or (isinstance(error, RunError) and not getattr(error, "every_rank", False)):
        where = "" if rank == 0 else f"rank {rank}: "
        hint = "" if debug() else f"; {DEBUG_ENV}=1 prints it here"
        log = f"traceback in {path}{hint}" if kept is True else f"its traceback could not be written to {path}: {kept}"
        print(f"parallel3d: error: {where}{one_line(error)} ({log})", file=sys.stderr, flush=True)


STOPPED_NOTE = ".stopped"  # in run_dir: why the last attempt stopped on purpose (exit 2 or 3)
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's count of this attempt's restarts


def note_stopped(run_dir: str | None, *, code: int, line: str) -> None:
    """Rank 0, when the run stops on purpose (a config error, a bad step that stops it): noted in
    run_dir, so that an attempt torchrun's ``--max-restarts`` starts after it ends at once."""
    if run_dir:
        with contextlib.suppress(OSError):
            (Path(run_dir) / STOPPED_NOTE).write_text(json.dumps({"exit": code, "line": line}))


def exit_if_stopped_before(run_dir: str | None, rank: int) -> None:
    """An attempt that torchrun restarted after one that stopped on purpose: nothing to retry (the
    same config, the same data, the same bad step), so it exits at once with the same code and
    line. A first attempt (a new command) clears an old note and runs."""
    note = Path(run_dir) / STOPPED_NOTE if run_dir else None
    if note is None or not note.is_file():
        return
    if int(os.environ.get(RESTART_ENV, "0") or 0) == 0:
        note.unlink(missing_ok=True)
        return
    try:
        stopped = json.loads(note.read_text())
        code, line = int(stopped["exit"]), str(stopped["line"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    if rank == 0:
        print(f"parallel3d: not restarted: the attempt before stopped on purpose (exit {code}), and a restart "
              f"would stop the same way: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


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
