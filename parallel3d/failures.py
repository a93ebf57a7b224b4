"""One clear line on the console for a failure, the traceback in a log file.

``report_failure`` writes the full traceback to ``run_dir/logs/rank<N>.log`` and prints one line
(rank 0, or the failing rank for a problem of its own). ``PARALLEL3D_DEBUG=1`` prints the
traceback on the console as well. Errors we can name (a corrupt file, an unwritable folder) are
``RunError``s (parallel3d/base.py) whose message names the file and the fix.
"""

from __future__ import annotations

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
    # Rank 0 speaks for all; another rank only for a problem of its own (an error every rank
    # raised together, ``every_rank``, is said once).
    if rank == 0 or (isinstance(error, RunError) and not getattr(error, "every_rank", False)):
        where = "" if rank == 0 else f"rank {rank}: "
        hint = "" if debug() else f"; {DEBUG_ENV}=1 prints it here"
        print(f"parallel3d: error: {where}{one_line(error)} (traceback in {path}{hint})", file=sys.stderr,
              flush=True)
