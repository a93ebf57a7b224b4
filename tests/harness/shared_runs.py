"""Runs of several files trained in one launch per rank count, through the session's run store.

A test file that trains a few runs of its own at 2 or 4 ranks pays a whole torchrun start-up
(every rank importing torch, building its model) for each launch. A file lists such runs as
``SHARED = {name: (ranks, overrides)}`` (or, where they depend on which of its tests were
selected, a function ``shared_runs_of(session)`` that returns them); whichever of these files
asks first trains the shared runs of every such file with a multirank test in the session
(tests/harness/store.py: one launch per rank count), and the others read what it wrote. Only
independent runs belong here: a run that resumes another's checkpoint could be trained before it.
"""

from __future__ import annotations

from harness.runs import Run
from harness.store import RunStore


def wanted_by(module, session) -> dict[str, tuple[int, list[str]]]:
    """``module``'s shared runs by name: its ``shared_runs_of(session)``, else its ``SHARED``."""
    runs_of = getattr(module, "shared_runs_of", None)
    return runs_of(session) if runs_of is not None else getattr(module, "SHARED", {})


def shared_runs(store: RunStore, session, module) -> dict[str, Run]:
    """``module``'s shared runs by name, trained with those of every file of the session that has
    a multirank test and shares runs."""
    modules = dict.fromkeys([*(item.module for item in session.items if item.get_closest_marker("multirank")), module])
    wanted = {f"{other.__name__}-{name}": spec for other in modules for name, spec in wanted_by(other, session).items()}
    records = store.get(wanted)
    return {name: Run.from_record(records[f"{module.__name__}-{name}"]) for name in wanted_by(module, session)}
