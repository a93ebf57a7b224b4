"""Stop requests from signals: a stop after the current step, with a checkpoint first.

``StopSignals`` turns SIGTERM (preemption; what torchrun forwards to its workers) and SIGUSR1
(Slurm's warning before the time limit, forwarded by the batch script) into "stop after this
step, with a checkpoint", and the run exits ``EXIT_REQUEUE``. The first Ctrl-C does the same and
says where the run is; a second one exits at once. ``resume_command`` is the command that
continues the run: the same launcher and overrides, with the run's own ``run_dir=`` (without it a
new start would make a new timestamped folder and train from step 1).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from parallel3d.runtime.failures import EXIT_REQUEUE
from parallel3d.runtime.rundir import key_of

MODULE = "parallel3d.train"


class Stopped(Exception):
    """Stopped on a signal after ``step``, with a checkpoint at ``checkpoint``."""

    def __init__(self, step: int, checkpoint: Path, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint {checkpoint}; "
                         f"exit {EXIT_REQUEUE}")
        self.step, self.checkpoint = step, checkpoint


def resume_command(*, overrides: list[str], run_dir: str | Path | None) -> str:
    """The shell command that continues this run: how it was started (``launcher``), its
    overrides, and ``run_dir=`` the run's own folder in place of any given (None: unknown)."""
    if run_dir is None:
        return shlex.join([*launcher(), *overrides])
    args = [a for a in overrides if key_of(a) != "run_dir"] + [f"run_dir={Path(run_dir).expanduser().resolve()}"]
    return shlex.join([*launcher(), *args])


def launcher() -> list[str]:
    """How this process was started, up to the module: under torchrun its agent's command (our
    parent's: torchrun's options kept), else ``python -m parallel3d.train``."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        try:
            argv = parent_argv()
            argv = argv[: argv.index(MODULE) + 1]
            if len(argv) > 1 and Path(argv[1]).name in ("torchrun", "parallel3d-run"):
                argv = argv[1:]  # an entry point run by its interpreter: the name a user types
            return argv
        except (OSError, ValueError):  # not Linux, or another launcher
            return ["torchrun", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', '1')}", "-m", MODULE]
    which = shutil.which("python")
    same = which is not None and os.path.realpath(which) == os.path.realpath(sys.executable)
    return ["python" if same else sys.executable, "-m", MODULE]


def parent_argv() -> list[str]:
    """The command line of this process's parent (Linux; OSError elsewhere)."""
    return [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]


def last_checkpoint(checkpoints: Path) -> str:
    from parallel3d.checkpoint.commit import complete_steps

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


class Interrupted(Exception):
    """A stop signal before the first step (while the data is prepared): nothing to checkpoint."""

    def __init__(self, signum: int, what: str):
        super().__init__(f"stopped by {signal.Signals(signum).name} while {what}, before the first step "
                         f"(finished shards are kept); exit {EXIT_REQUEUE}")
        self.signum = signum


@contextmanager
def interruptible(what: str):
    """Inside the block SIGTERM and SIGUSR1 raise ``Interrupted``: long work before the training
    loop (tokenizing data.sources) stops at once, with one line, and the run's lock released."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(signum, what)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
