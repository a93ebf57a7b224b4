"""Hangs named: which rank stopped answering, at which step, in which collective.

A collective that waits longer than ``train.dist_timeout_s`` fails, but its error names neither the
rank that never came nor where the others were. Each rank therefore runs one daemon thread that

* beats: every ``beat_s`` seconds it writes ``<beats> <step>`` under its rank in the process
  group's TCPStore (a background write; the training step itself never touches the store);
* watches: once training has started, when the loop has not marked a new step for
  ``dist_timeout_s - 4 * beat_s`` (a bit before the collective's timeout) it dumps every thread's Python stack into
  ``run_dir/logs/rank<N>.log`` (faulthandler) and reads every rank's beats twice, ``2 * beat_s``
  apart: a rank whose count did not move has stopped answering (stopped, frozen, or dead).

When the collective then fails, :func:`explain` turns its error into one line naming those ranks,
the step and the collective (the innermost torch.distributed call on the main thread). A rank
that itself did not run for that long (SIGSTOP, a frozen machine) sees the gap in its own beats
and says so instead of blaming the others. A stopped process cannot dump its own stack: it does
once it runs again.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from parallel3d.base import RunError

KEY = "parallel3d/heartbeat/"
TIMEOUT_WORDS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe")
_current: Watchdog | None = None


class HangError(RunError):
    """A collective failed because a rank stopped answering; the message names it."""


@dataclass
class Hang:
    step: int
    where: str  # the collective and the parallel3d line that called it, where known
    silent: list[int] = field(default_factory=list)  # ranks whose beats stopped
    steps: dict[int, int] = field(default_factory=dict)  # each rank's step in its last heartbeat
    frozen_s: float = 0.0  # this rank itself did not run for this long


class Watchdog:
    """This rank's heartbeat writer and stall watcher (a daemon thread); see the module docstring."""

    def __init__(self, *, store, rank: int, world_size: int, timeout_s: float, log_path: Path,
                 announce: bool = False):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.log_path, self.announce = log_path, announce
        self.beat_s = min(max(timeout_s / 20, 0.25), 5.0)
        self.fire_after = max(timeout_s - 4 * self.beat_s, timeout_s / 2)
        self.step, self.last_progress = 0, time.monotonic()
        self.hang: Hang | None = None
        self._diagnosed, self._stop = threading.Event(), threading.Event()
        self._frozen_s, self._fired_at = 0.0, None
        self._thread = threading.Thread(target=self._run, daemon=True, name="parallel3d-watchdog")

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.beat_s + 1)

    def mark(self, step: int) -> None:
        """The loop reached ``step`` (an attribute write: no store traffic on the training path)."""
        self.step, self.last_progress = step, time.monotonic()

    def _run(self) -> None:
        last_tick, beats = time.monotonic(), 0
        while not self._stop.wait(self.beat_s):
            now = time.monotonic()
            if now - last_tick > self.fire_after:  # this process was not running (SIGSTOP, a frozen host)
                self._frozen_s = now - last_tick
            last_tick, beats = now, beats + 1
            try:
                self.store.set(f"{KEY}{self.rank}", f"{beats} {self.step}")
            except Exception:  # the store is gone (the run is ending): nothing left to tell
                return
            stalled = self.step > 0 and now - self.last_progress > self.fire_after  # armed by the first step
            if stalled and self._fired_at is None:
                self._fired_at = now
                self._fire()
            elif not stalled:  # training moved on: a later stall is a new one
                self._fired_at, self._frozen_s = None, 0.0

    def _fire(self, where: str | None = None) -> None:
        where = main_thread_collective() if where is None else where
        with open(self.log_path, "a") as f:
            f.write(f"parallel3d watchdog: rank {self.rank} at step {self.step}: no progress for "
                    f"{time.monotonic() - self.last_progress:.0f} s{' in ' + where if where else ''}; "
                    f"train.dist_timeout_s={self.timeout_s:g}. Python stacks of every thread:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        first = self.read_beats()
        time.sleep(2 * self.beat_s)
        second = self.read_beats()
        silent = [r for r in range(self.world_size)
                  if r != self.rank and (second.get(r) is None or second[r][0] == first.get(r, (None,))[0])]
        steps = {r: beat[1] for r, beat in second.items()}
        self.hang = Hang(self.step, where, silent, steps, self._frozen_s)
        with open(self.log_path, "a") as f:
            f.write(f"parallel3d watchdog: {hang_line(self.hang, self.rank)}\n")
        self._diagnosed.set()
        if self.announce and silent and self.rank == min(set(range(self.world_size)) - set(silent)):
            print(f"parallel3d: error: {hang_line(self.hang, self.rank)}; the collective times out at "
                  f"train.dist_timeout_s={self.timeout_s:g} s. Stacks in {self.log_path.parent}/rank<N>.log, "
                  f"NCCL's flight recorder in {self.log_path.parent}/nccl_trace_rank_<N>", file=sys.stderr, flush=True)

    def read_beats(self) -> dict[int, tuple[int, int]]:
        """(beats, step) of every rank that has beaten, from the store."""
        found = {}
        for r in range(self.world_size):
            key = f"{KEY}{r}"
            try:
                if self.store.check([key]):
                    beats, step = self.store.get(key).decode().split()
                    found[r] = (int(beats), int(step))
            except Exception:  # an unreachable store: every rank counts as silent
                continue
        return found

    def diagnosis(self, error: BaseException | None = None) -> Hang | None:
        """The hang seen (waiting for a diagnosis under way), or one read now after a quick failure
        (a peer died): then the collective is the one ``error`` was raised in, not where the main
        thread is now (handling it)."""
        if self._fired_at is not None:
            self._diagnosed.wait(timeout=3 * self.beat_s + 1)
        elif self.hang is None:
            self._fired_at = time.monotonic()
            self._fire(collective_at(raised_at(error)) if error is not None else None)
        return self.hang


def main_thread_collective() -> str:
    """The innermost torch.distributed function on the main thread and the parallel3d line under it."""
    return collective_at(sys._current_frames().get(threading.main_thread().ident))


def raised_at(error: BaseException):
    """The innermost frame of ``error``'s traceback (None without one)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None


def collective_at(frame) -> str:
    """The innermost torch.distributed function from ``frame`` outwards, and the parallel3d line under it."""
    collective = caller = ""
    while frame is not None:
        path, name = frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name
        if not collective and "/torch/distributed/" in path:
            collective = name
        if "/parallel3d/" in path and "/watchdog.py" not in path:
            caller = f"{path[path.rindex('/parallel3d/') + 1:]}:{frame.f_lineno} ({name})"
            break
        frame = frame.f_back
    return " called from ".join(part for part in (collective, caller) if part)


def hang_line(hang: Hang, rank: int) -> str:
    where = f" in {hang.where}" if hang.where else ""
    if hang.frozen_s:
        return (f"rank {rank} itself did not run for {hang.frozen_s:.0f} s (stopped, or its machine froze) "
                f"around step {hang.step}{where}; the other ranks gave up on it")
    if hang.silent:
        ranks = ", ".join(f"{r}{f' (last seen at step {hang.steps[r]})' if r in hang.steps else ''}"
                          for r in hang.silent)
        return (f"rank{'s' if len(hang.silent) > 1 else ''} {ranks} stopped answering (no heartbeat) while "
                f"rank {rank} waited at step {hang.step}{where}")
    behind = min(hang.steps.values(), default=hang.step)
    late = [r for r, s in hang.steps.items() if s == behind]
    if behind < hang.step:
        return (f"ranks {', '.join(map(str, late))} are alive but still at step {behind} while rank {rank} waited "
                f"at step {hang.step}{where}")
    return (f"every rank is alive at step {hang.step} but the collective{where} did not complete (ranks called "
            f"different collectives, or it is slower than the timeout)")


def start(*, timeout_s: float, log_path: Path) -> Watchdog | None:
    """Start this rank's watchdog over the default process group's store (several ranks only)."""
    global _current
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    # NCCL's own watchdog aborts the process when the collective times out, before explain() could
    # run: ours says it on the console when it finds a silent rank.
    _current = Watchdog(store=store, rank=dist.get_rank(), world_size=dist.get_world_size(), timeout_s=timeout_s,
                        log_path=log_path, announce=dist.get_backend() == "nccl").start()
    return _current


def stop() -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None


def mark(step: int) -> None:
    if _current is not None:
        _current.mark(step)


def log_to(path: Path) -> None:
    """Once run_dir is known: dumps go to its logs/rank<N>.log."""
    if _current is not None:
        _current.log_path = path


def explain(error: BaseException) -> BaseException:
    """``error`` itself, or, for a collective that timed out or lost a peer while the watchdog ran,
    an error whose message names the ranks, the step and the collective. Only the lowest rank that
    still answers gets a HangError (printed on the console); the others log the same line."""
    if _current is None or not (isinstance(error, dist.DistError) or any(w in str(error) for w in TIMEOUT_WORDS)):
        return error
    hang = _current.diagnosis(error)
    if hang is None:
        return error
    timed_out = "imed out" in str(error)  # else a peer's connection closed: it died
    failed = f"timed out after train.dist_timeout_s={_current.timeout_s:g} s" if timed_out else "failed"
    line = (f"{hang_line(hang, _current.rank)}: a collective {failed} ({' '.join(str(error).split())[:200]}). "
            f"Every rank's Python stack is in "
            f"{_current.log_path.parent}/rank<N>.log. Fix: find out why {_culprit(hang, _current.rank)} hung "
            f"(its log, its machine); raise train.dist_timeout_s if a step legitimately takes longer")
    reporter = min((r for r in range(_current.world_size) if r not in hang.silent), default=_current.rank)
    named = RuntimeError(line) if hang.frozen_s or reporter != _current.rank else HangError(line)
    named.__cause__ = error  # the log keeps the collective's own traceback
    return named


def _culprit(hang: Hang, rank: int) -> str:
    if hang.frozen_s:
        return f"rank {rank}"
    return "rank " + ", ".join(map(str, hang.silent)) if hang.silent else "the ranks named"
