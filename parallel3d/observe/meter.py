"""What a step measures: throughput, MFU and memory since the last logged step, and every rank's
own step time and data wait, so a slow rank can be named.

In synchronous training every rank's wall time per step is the same: the fast ranks wait for
the slow one inside the step's collectives. What differs is how much of the step a rank spent
working rather than waiting, so a rank's step time here is its busy time: on CPU devices the
main thread's CPU time (a rank blocked in a collective or sleeping uses none; the main thread
takes its share of torch's intra-op work); on CUDA devices the host's wall time (the host spins
while it waits for the GPU, so its CPU time would say no more), which there equals
``step_time_s`` on every rank (docs/observability.md). Each logging step gathers a few numbers per rank in one all_gather,
which also carries the memory figures of which the largest is reported: no extra collective.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from parallel3d.base import all_gather_single, rank
from parallel3d.models import flops_per_token
from parallel3d.observe.metrics import max_memory_bytes, model_state_bytes, peak_flops
from parallel3d.runtime.straggler import StragglerWatch, burn, gather_hostnames
from parallel3d.step import Setup

# The per-rank figures of one logging step, in the order they are gathered.
MEMORY = ("max_memory_bytes", "param_bytes", "grad_bytes", "optim_state_bytes")
PER_RANK = (*MEMORY, "busy_s", "data_wait_s")


class StepMeter:
    """Throughput, MFU and memory since the last read, the largest rank's memory over the world,
    and each rank's busy time and data wait per step (max, min and the rank of the max)."""

    def __init__(self, setup: Setup, warn: Callable[[str], None] = print):
        self.setup, self.warn = setup, warn
        c = setup.config
        self.stragglers = StragglerWatch(factor=c.logging.straggler_factor, steps=c.logging.straggler_steps,
                                         hosts=gather_hostnames())
        own = rank()
        self.slow_s = c.debug.slow_rank_s if c.debug.slow_rank == own else 0.0
        t = setup.config.train
        self.global_tokens = t.global_batch_size * t.seq_len
        self.flops = flops_per_token(setup.config.model, t.seq_len)
        self.peak = peak_flops(setup.device, t.param_dtype)
        self.state_bytes: dict[str, int] = {}
        self.busy_clock = time.thread_time if setup.device.type == "cpu" else time.perf_counter
        self.since, self.steps, self.data_wait_s, self.busy_s = time.perf_counter(), 0, 0.0, 0.0
        self.step_started = self.busy_clock()
        self.last: dict[str, list[float]] = {}  # the last read's per-rank figures, rank by rank

    def start(self) -> None:
        """A step's work begins (after its batches arrived)."""
        self.step_started = self.busy_clock()
        if self.slow_s:
            burn(self.slow_s, self.busy_clock)

    def stepped(self, data_wait_s: float) -> None:
        self.busy_s += self.busy_clock() - self.step_started
        if not self.state_bytes:  # the first step (of this process): the optimizer state now exists
            self.state_bytes = model_state_bytes(self.setup.model, self.setup.optimizer)
        self.steps += 1
        self.data_wait_s += data_wait_s

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Wall time that is not training (writing a trace): left out of the step time and throughput."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.since += time.perf_counter() - start

    def read(self, step: int) -> dict:
        elapsed = time.perf_counter() - self.since
        step_time, tokens_per_sec = elapsed / self.steps, self.global_tokens * self.steps / elapsed
        mine = [max_memory_bytes(self.setup.device), *self.state_bytes.values(), self.busy_s / self.steps,
                self.data_wait_s / self.steps]  # data wait: time a step waited for its batches
        self.since, self.steps, self.data_wait_s, self.busy_s = time.perf_counter(), 0, 0.0, 0.0
        ranks = gather_per_rank(mine, self.setup.device)
        self.last = {key: list(values) for key, values in zip(PER_RANK, zip(*ranks))}
        for line in self.stragglers.check(step, self.last["busy_s"]):
            self.warn(line)
        memory = {key: int(max(values)) for key, values in self.last.items() if key in MEMORY}
        return {"tokens_per_sec": tokens_per_sec, "step_time_s": step_time,
                "mfu": tokens_per_sec * self.flops / (self.peak * len(ranks)) if self.peak else None,
                **memory, "max_memory_rank": argmax(self.last["max_memory_bytes"]),
                "data_wait_s": mine[-1], **spread(self.last["busy_s"], "step_time", "slowest_rank"),
                **spread(self.last["data_wait_s"], "data_wait", "slowest_data_rank")}


def gather_per_rank(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), in rank order: one all_gather (on gloo
    cheaper than an all_reduce of a table with a row per rank, BENCHMARKS.md (i))."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)  # NCCL gathers device tensors only
    if not dist.is_initialized():
        return [list(values)]
    every = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    all_gather_single(every, mine)
    return every.view(dist.get_world_size(), len(values)).tolist()


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def spread(values: list[float], name: str, slowest: str) -> dict:
    """``name``_max_s, ``name``_min_s over the ranks, and the rank of the max."""
    return {f"{name}_max_s": max(values), f"{name}_min_s": min(values), slowest: argmax(values)}
