"""Training runs shared by the whole test session, across pytest-xdist's workers.

A run is named by what it trains: its rank count and overrides. The first test, in any worker,
that asks for a run trains it (several at a time in one launch: tests/harness/layout_batch.py); every
other test that asks for the same run, in this file or another, on this worker or another, reads
what it wrote. A layout that several files check (the one-process parity references and their
twins above all) is then trained once per session instead of once per file and worker.

Workers agree through the file system: a run's lock (``fcntl.flock``) is held by the worker that
trains it, and its record (``<key>.json``: directory, exit code, output) is written when the
training ends. A worker that finds a run locked trains its own first, then waits for the lock.
A run a test reads is read-only for it: a test that changes a run's folder (a resume into it, a
damaged file) copies it first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Callable

# name: (ranks, overrides)
Wanted = dict[str, tuple[int, list[str]]]
# (root, {name: overrides}, ranks) -> {name: result record} for the runs that succeeded
BatchLauncher = Callable[[Path, dict[str, list[str]], int], dict[str, dict]]
# (run_dir, overrides, ranks) -> result record
SingleLauncher = Callable[[Path, list[str], int], dict]


def run_key(nproc: int, overrides: list[str]) -> str:
    """What a run trains, as a short digest: its rank count and its overrides as Hydra applies
    them (the last value of each key counts, and their order does not)."""
    values = {override.split("=", 1)[0]: override for override in overrides}
    return hashlib.sha1(json.dumps([nproc, sorted(values.values())]).encode()).hexdigest()[:12]


def shared_root(basetemp: Path) -> Path:
    """The session's folder that every xdist worker sees: the parent of a worker's basetemp
    (``.../pytest-N/popen-gw0``), or the basetemp itself without xdist."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "shared-runs"


class RunStore:
    """Runs by (ranks, overrides), trained once per session: ``get`` returns the record of each
    wanted run (``run_dir``, ``returncode``, ``stdout``, ``stderr``), training the missing ones."""

    def __init__(self, root: Path, launch_batch: BatchLauncher, launch_one: SingleLauncher, batch_size: int):
        self.root, self.launch_batch, self.launch_one, self.batch_size = root, launch_batch, launch_one, batch_size
        root.mkdir(parents=True, exist_ok=True)

    def record(self, key: str) -> dict | None:
        path = self.root / f"{key}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def get(self, wanted: Wanted, spare: Wanted | None = None) -> dict[str, dict]:
        """``spare``: runs other tests will want (other files' parity matrices), trained now in the
        room this call's last batch of each rank count leaves, so that they need no launch of their
        own; never waited for, and not returned."""
        keys = {name: run_key(nproc, overrides) for name, (nproc, overrides) in wanted.items()}
        found = {name: self.record(key) for name, key in keys.items()}
        missing = {name: wanted[name] for name, record in found.items() if record is None}
        with contextlib.ExitStack() as held:
            mine = {name: spec for name, spec in missing.items() if self._try_lock(held, keys[name])}
            theirs = {name: spec for name, spec in missing.items() if name not in mine}
            mine = {name: spec for name, spec in mine.items() if self.record(keys[name]) is None}
            extra = self._take_spare(held, mine, spare or {}, keys)
            found |= self._train(mine | extra, keys)
        for name, spec in theirs.items():  # another worker trains these: wait for it to finish
            with self._lock(keys[name]):
                found[name] = self.record(keys[name]) or self._train({name: spec}, keys)[name]
        return {name: found[name] or self.record(keys[name]) for name in wanted}

    def _take_spare(self, held: contextlib.ExitStack, mine: Wanted, spare: Wanted, keys: dict[str, str]) -> Wanted:
        """The spare runs that fill this call's batches: of a rank count it trains, up to the room
        its last batch leaves, untrained and not locked by another worker (their keys join ``keys``)."""
        room = {nproc: -count % self.batch_size for nproc, count in Counter(n for n, _ in mine.values()).items()}
        taken: Wanted = {}
        for name, (nproc, overrides) in spare.items():
            key = run_key(nproc, overrides)
            if room.get(nproc, 0) == 0 or name in keys or key in keys.values() or self.record(key) is not None:
                continue
            if self._try_lock(held, key) and self.record(key) is None:
                taken[name], keys[name] = (nproc, overrides), key
                room[nproc] -= 1
        return taken

    def _train(self, runs: Wanted, keys: dict[str, str]) -> dict[str, dict]:
        """Train ``runs`` (locked by this worker) in batches of one rank count, each failed one again
        in a launch of its own (its own errors), and record every result."""
        done: dict[str, dict] = {}
        for nproc in sorted({n for n, _ in runs.values()}):
            group = {name: o for name, (n, o) in runs.items() if n == nproc}
            names = list(group)
            for start in range(0, len(names), self.batch_size):
                chunk = {name: group[name] for name in names[start:start + self.batch_size]}
                dirs = {name: self.run_dir(name, keys[name]) for name in chunk}
                batch = self.launch_batch(self.root, {dirs[name].name: o for name, o in chunk.items()}, nproc)
                for name, overrides in chunk.items():
                    done[name] = batch.get(dirs[name].name) or self.launch_one(dirs[name], overrides, nproc)
        for name, record in done.items():
            path = self.root / f"{keys[name]}.json"
            path.with_suffix(".tmp").write_text(json.dumps(record))
            path.with_suffix(".tmp").replace(path)
        return done

    def run_dir(self, name: str, key: str) -> Path:
        return self.root / f"{name}-{key}"

    def _try_lock(self, held: contextlib.ExitStack, key: str) -> bool:
        handle = held.enter_context(open(self.root / f"{key}.lock", "w"))
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    @contextlib.contextmanager
    def _lock(self, key: str):
        with open(self.root / f"{key}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield
