"""The run directory: where it is, who owns it, and what a fresh start does to an old run in it.

    run_dir/
        .lock              {"host", "pid"} of the live run (rank 0's process) that owns the folder
        config.yaml        the resolved config of the latest start
        metrics.jsonl      one row per logged step
        checkpoints/       step_<N>/ (see checkpoint.py)
        logs/rank<N>.log   full tracebacks of failures (the console gets one line)
        previous-<UTC>/    an earlier run, moved aside by a start with checkpoint.resume=none

Hydra picks its output dir per process (a timestamp); every rank uses rank 0's. The launchers
(launch/run.py, launch/sweep.py, launch/slurm.py) and train.py all read "which run_dir= was
given" here, so nothing in launch/ imports train.py and train.py imports nothing from launch/.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from parallel3d.base import rank

MULTIRUN_FLAGS = ("-m", "--multirun")
LOCK = ".lock"
# What a run writes at the top of its run_dir; moved aside together by a fresh start.
RUN_FILES = ("checkpoints", "metrics.jsonl", "config.yaml", "wandb", "logs", "hf", "model.safetensors")


class RunDirError(RuntimeError):
    """The run_dir cannot be used as asked: the message names the folder and the fix."""


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


def given_run_dir(overrides: list[str]) -> str | None:
    """The value of the last ``run_dir=`` override as Hydra reads it, or None: ``run_dir="/a b"``
    names ``/a b`` (taken as it was typed, it made a stray ``./"/a b"/`` tree)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    given = [o for o in overrides if key_of(o) == "run_dir"]
    if not given:
        return None
    try:
        value = OverridesParser.create().parse_overrides([given[-1]])[0].value()
    except HydraException:  # Hydra itself will say what is wrong with it
        value = None
    return value if isinstance(value, str) else given[-1].split("=", 1)[1]


def run_dir_override(path: str | os.PathLike) -> str:
    """The override that makes ``path`` the run's output dir (and so its run_dir) on rank 0."""
    path = os.path.abspath(path)
    quoted = path.replace("\\", "\\\\").replace("'", "\\'")  # an OmegaConf quoted string: any path
    return f"hydra.run.dir=${{p3d.rank0_dir:'{quoted}'}}"


def rank0_dir(path: str) -> str:
    """Hydra's output dir on rank 0; a scratch dir on other ranks (rank 0 shares its run_dir)."""
    return path if rank() == 0 else os.path.join(tempfile.gettempdir(), f"parallel3d-rank{rank()}")


def register_rank0_dir() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("p3d.rank0_dir", rank0_dir, replace=True)


def output_dir_is_run_dir(argv: list[str]) -> list[str]:
    """With a literal ``run_dir=PATH`` and no ``hydra.run.dir``, make PATH Hydra's output dir as
    well: Hydra creates its run dir whatever run_dir says, leaving empty outputs/DATE/TIME folders."""
    given = given_run_dir(argv[1:])
    if given is None or "${" in given or any(key_of(a) == "hydra.run.dir" or a in MULTIRUN_FLAGS for a in argv):
        return argv
    return [*argv, run_dir_override(given)]


def unwritable_run_dir(argv: list[str]) -> str | None:
    """Rank 0's one-line problem with a literal ``run_dir=`` it cannot write, or None. Checked
    before Hydra starts: Hydra creates its output dir first and would fail with a traceback."""
    given = given_run_dir(argv[1:])
    if rank() != 0 or given is None or "${" in given:
        return None
    return _make_writable(Path(given).expanduser())


def agree_on_run_dir(run_dir: str) -> Path:
    """Every rank writes under rank 0's run_dir (ranks may disagree on Hydra's timestamp).
    Rank 0 creates it; an unwritable folder is one RunDirError on every rank."""
    problem = None
    if rank() == 0:
        problem = _make_writable(Path(run_dir).expanduser())
    if dist.is_initialized():
        box = [run_dir, problem]
        dist.broadcast_object_list(box, src=0)
        run_dir, problem = box
    if problem:
        raise RunDirError(problem)
    return Path(run_dir).expanduser().resolve()


def _make_writable(path: Path) -> str | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return (f"run_dir={path} is not writable ({e.strerror}). Fix: set run_dir= to a folder you can write, "
                f"or fix its permissions")
    return None


class RunLock:
    """``run_dir/.lock`` while a run is live: a second run there is refused, naming the holder; a
    lock whose process is gone (same host, pid not alive) is taken over with a message. Rank 0
    holds it for the job; a restarted job (torchrun --max-restarts, a requeue) has a new pid and
    finds its predecessor's lock stale."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.held = False

    def acquire(self) -> str | None:
        """Take the lock; returns a message to print (a stale lock taken over), or raises RunDirError."""
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                            time.gmtime())}
        note = None
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and _alive(holder):
                    raise RunDirError(
                        f"run_dir={self.path.parent} is in use by the run of pid {holder['pid']} on "
                        f"{holder['host']} (since {holder.get('started', '?')}). Fix: wait for it, stop it, or "
                        f"set another run_dir=; if that process is gone, delete {self.path}") from None
                what = "an unreadable lock" if holder is None else f"pid {holder['pid']} on {holder['host']}"
                note = f"parallel3d: took over the stale lock {self.path} ({what}, no longer running)"
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return note
        raise RunDirError(f"run_dir={self.path.parent}: could not take {self.path}. Fix: delete it and start again")

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if {"host", "pid"} <= holder.keys() else None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


def _alive(holder: dict) -> bool:
    """Whether the lock's process runs. On another host it cannot be checked: assumed alive."""
    if holder["host"] != socket.gethostname():
        return True
    if holder["pid"] == os.getpid():
        return False  # a lock of our own pid can only be a leftover (pid reused in a container)
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


def own_run_dir(run_dir: Path, fresh_start: bool) -> RunLock:
    """Rank 0 takes ``run_dir``'s lock and, for a fresh start (checkpoint.resume=none), moves an
    earlier run aside; every rank raises the same RunDirError when the folder is someone else's."""
    lock, outcome = RunLock(run_dir), None
    if rank() == 0:
        try:
            notes = [lock.acquire()]
            aside = move_earlier_run_aside(run_dir) if fresh_start else None
            if aside is not None:
                notes.append(f"parallel3d: checkpoint.resume=none: moved the earlier run in {run_dir} to {aside}")
            outcome = ("notes", [n for n in notes if n])
        except (RunDirError, OSError) as e:
            lock.release()
            outcome = ("error", str(e))
    if dist.is_initialized():
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    kind, text = outcome
    if kind == "error":
        raise RunDirError(text)
    for line in text:
        print(line, file=sys.stderr, flush=True)
    return lock


def move_earlier_run_aside(run_dir: Path) -> Path | None:
    """The earlier run's files go to ``run_dir/previous-<UTC time>/``: nothing is deleted, and no
    checkpoint of it can be resumed by mistake later. Returns the folder, or None when there was nothing."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not found:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside, n = run_dir / f"previous-{stamp}", 1
    while aside.exists():
        aside, n = run_dir / f"previous-{stamp}-{n}", n + 1
    aside.mkdir()
    for name in found:
        os.replace(run_dir / name, aside / name)
    return aside


def release_run_dir(run_dir: str | os.PathLike | None) -> None:
    """Remove ``run_dir``'s lock if this process holds it (a no-op on other ranks, or without one)."""
    if not run_dir:
        return
    lock = RunLock(Path(run_dir).expanduser())
    holder = lock._holder()
    if holder and holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
        lock.path.unlink(missing_ok=True)


def hydra_run_dir(overrides: list[str]) -> str:
    """``hydra.run.dir`` as rank 0 of a run started now with these overrides would resolve it."""
    return str(hydra_settings(overrides).run.dir)


def hydra_settings(overrides: list[str]):
    """The ``hydra`` node of the config these overrides compose, resolved now (timestamps included)."""
    from hydra import compose, initialize_config_dir

    from parallel3d.config.compose import CONF_DIR, register_configs

    register_configs()
    register_rank0_dir()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True).hydra
