"""Runs of several files trained in one launch per rank count, through the session's run store.

A test file that trains a few runs of its own at 2 or 4 ranks pays a whole torchrun start-up
(every rank importing torch, building its model) for each launch. A file lists such runs as
``SHARED = {name: (ranks, overrides)}`` (or, where they depend on which of its tests were
selected, a function ``shared_runs_of(session)`` that returns them) and names itself in
``FILES``; whichever of these files
asks first trains the shared runs of every file the session selected (tests/harness/store.py:
one launch per rank count), and the others read what it wrote. Only independent runs belong
here: a run that resumes another's checkpoint could be trained before it.
"""

from __future__ import annotations

import importlib

from harness.runs import Run
from harness.store import RunStore

# The files whose SHARED runs train together (module names, as pytest imports them).
FILES = ("test_checkpoint", "test_checkpoint_failures", "test_guard", "test_observability", "test_recovery")


def selected_files(session) -> list[str]:
    """The files of FILES with a multirank test in this session (their runs need torchrun)."""
    stems = {item.path.stem for item in session.items if item.get_closest_marker("multirank")}
    return [name for name in FILES if name in stems]


def wanted_by(file: str, session) -> dict[str, tuple[int, list[str]]]:
    module = importlib.import_module(file)
    return module.shared_runs_of(session) if hasattr(module, "shared_runs_of") else module.SHARED


def shared_runs(store: RunStore, session, file: str) -> dict[str, Run]:
    """``file``'s shared runs by name, trained with those of every selected file of FILES."""
    wanted = {}
    for stem in sorted({*selected_files(session), file}):
        wanted |= {f"{stem}-{name}": spec for name, spec in wanted_by(stem, session).items()}
    records = store.get(wanted)
    return {name: Run.from_record(records[f"{file}-{name}"]) for name in wanted_by(file, session)}
