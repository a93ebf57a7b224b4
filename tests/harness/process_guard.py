"""What ``-m "not multirank"`` promises, kept: no torchrun job and no rank processes in a session
that selected no multirank test (tests/test_markers.py proves the guard)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

# What starts a torchrun job: torchrun itself, or parallel3d-run (which hands over to it).
TORCHRUN_COMMANDS = {"torchrun", "torch.distributed.run", "parallel3d-run", "parallel3d.launch.run"}


def starts_torchrun(args) -> bool:
    """Whether a command (as subprocess takes it: a list, or one string) runs torchrun."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return any(Path(word).name in TORCHRUN_COMMANDS for arg in argv for word in os.fsdecode(arg).split())


def runs_test_code(process) -> bool:
    """Whether a multiprocessing process (mp.spawn's too) runs a test file's function: a rank."""
    target = getattr(process, "_target", None)
    if getattr(target, "__module__", "") == "torch.multiprocessing.spawn":  # mp.spawn's _wrap(fn, ...)
        target = (getattr(process, "_args", ()) or (None,))[0]
    return Path(getattr(getattr(target, "__code__", None), "co_filename", "")).name.startswith("test_")


@pytest.fixture(scope="session", autouse=True)
def torchrun_only_in_multirank_tests(request):
    """``-m "not multirank"`` promises a run without torchrun jobs or rank processes: in a session
    that selected no multirank test, starting a torchrun job, or a second process running test code
    while one is alive (mp.spawn, multiprocessing), fails the test (or fixture) that tried, naming
    the missing mark. (Where multirank tests run too, a shared fixture may start the jobs anywhere.)"""
    if any(item.get_closest_marker("multirank") for item in request.session.items):
        yield
        return
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def refusing(what: str):
        pytest.fail(f"this test is not marked multirank but starts {what}: mark it @pytest.mark.multirank")

    def refusing_torchrun(self, args, *rest, **kwargs):
        if starts_torchrun(args):
            refusing(f"torchrun ({args})")
        popen_init(self, args, *rest, **kwargs)

    ranks = []  # the processes started that run test code (start() drops their target)

    def refusing_ranks(self):
        if runs_test_code(self):
            if peers := [rank for rank in ranks if rank.is_alive()]:
                for peer in peers:
                    peer.kill()  # waiting for this one at their rendezvous: ended here, not left behind
                    peer.join(timeout=10)  # and reaped, or a later test would still find it alive
                refusing(f"rank processes ({self._target})")
            ranks.append(self)
        process_start(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "__init__", refusing_torchrun)
        patch.setattr(multiprocessing.process.BaseProcess, "start", refusing_ranks)
        yield
