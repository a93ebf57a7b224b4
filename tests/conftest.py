"""The suite's fixtures and hooks; the harness itself (runs, parity matrices, the shared run
store, tolerances, test files) is the ``harness`` package beside this file."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from harness.parity import Parity
from harness.process_guard import torchrun_only_in_multirank_tests  # noqa: F401  (a session fixture: see there)
from harness.runs import BATCH_SIZE, Run, batch_records, one_record
from harness.store import RunStore, shared_root

# The committed per-test CPU log (P3D_TEST_CPU_LOG of a whole run; tools/suite_cpu.py reads it).
CPU_LOG = Path(__file__).with_name("cpu_log.jsonl")


def pytest_collection_modifyitems(items) -> None:
    """The files that cost the most CPU first, by the committed log: pytest-xdist hands whole files
    to its workers in collection order, so none of the long ones is left running alone at the end
    (files the log does not know keep their order, after those it does)."""
    if not CPU_LOG.exists():
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from suite_cpu import per_file

    cost = {Path(name).name: seconds for name, seconds in per_file([CPU_LOG]).items()}
    items.sort(key=lambda item: -cost.get(item.path.name, 0.0))  # stable: the others keep their order


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``P3D_TEST_CPU_LOG=FILE``: append each test's CPU seconds (its own process and the torchrun
    jobs it waited for, module fixtures included where they first ran) as a JSON line. Unlike wall
    time it hardly changes with the machine's load: it is what the suite's budget is made of."""
    log = os.environ.get("P3D_TEST_CPU_LOG")
    if not log:
        return (yield)
    import resource

    def cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    start = cpu()
    try:
        return (yield)
    finally:
        with open(log, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(cpu() - start, 2)}) + "\n")


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, at most 4 (a worker's jobs start up to 8 ranks each)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that leaves the default process group up fails here, not the in-process tests after it
    (which could not start their own: "trying to initialize the default process group twice")."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left the default process group initialized: destroy it where it was created")


@pytest.fixture(scope="session")
def runs_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="session")
def run_store(tmp_path_factory) -> RunStore:
    """The session's shared runs (tests/harness/store.py), seen by every xdist worker."""
    return RunStore(shared_root(tmp_path_factory.getbasetemp()), batch_records, one_record, BATCH_SIZE)


@pytest.fixture(scope="session")
def parity(run_store) -> Parity:
    return Parity(run_store)


@pytest.fixture(scope="session")
def reference_run(parity) -> Run:
    """The single-process run every layout must reproduce (shared, run once)."""
    return parity.reference()


DESELECTED: list[str] = []  # tests/test_inventory.py: this session collected its items and these


def pytest_deselected(items) -> None:
    DESELECTED.extend(item.nodeid for item in items)
