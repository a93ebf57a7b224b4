"""Name a rank that is slower than the others, on the console, with its host.

A rank is a straggler at a logging step when its step time (its busy time, parallel3d/observe/meter.py)
is over ``logging.straggler_factor`` times the median over the ranks; after
``logging.straggler_steps`` such logging steps in a row it gets one line, and another only after
it has recovered and fallen behind again. ``debug.slow_rank`` makes a rank slow on purpose, to
show that this works.
"""

from __future__ import annotations

import socket
import statistics
from typing import Callable

import torch.distributed as dist


def gather_hostnames() -> list[str]:
    """Every rank's host name, in rank order (one collective, once per run)."""
    host = socket.gethostname()
    if not dist.is_initialized():
        return [host]
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    return [str(h) for h in hosts]


class StragglerWatch:
    """Counts, per rank, the logging steps in a row it was a straggler at."""

    def __init__(self, *, factor: float, steps: int, hosts: list[str]):
        self.factor, self.steps, self.hosts = factor, steps, hosts
        self.streak = [0] * len(hosts)

    def check(self, step: int, step_times: list[float]) -> list[str]:
        """The lines to print at this logging step: one per rank that just became a straggler."""
        if not self.factor or len(step_times) < 2:
            return []
        median = statistics.median(step_times)
        lines = []
        for rank, seconds in enumerate(step_times):
            slow = seconds > self.factor * median
            self.streak[rank] = self.streak[rank] + 1 if slow else 0
            if self.streak[rank] == self.steps:
                lines.append(f"parallel3d: straggler: rank {rank} on {self.hosts[rank]} took {seconds:.3f} s per "
                             f"step, {seconds / median:.1f}x the ranks' median ({median:.3f} s), for "
                             f"{self.steps} logged steps up to step {step}")
        return lines


def burn(seconds: float, clock: Callable[[], float]) -> None:
    """Compute for ``seconds`` of ``clock`` (debug.slow_rank): a slower device works longer, it does
    not sleep (a sleeping rank would look idle, not slow, by the CPU time the meter reads)."""
    end = clock() + seconds
    while clock() < end:
        pass
