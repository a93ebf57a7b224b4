"""torch.profiler traces and CUDA memory snapshots of chosen steps (``profile.*``).

``profile.steps=[a, b]`` records steps a to b on every rank (or ``profile.ranks``) as one window:
``run_dir/profile/step<a>/rank<R>.json``, a Chrome trace (chrome://tracing, https://ui.perfetto.dev),
and a summary in the rank's log (rank 0's on the console): the operators with the most self time
and the time per step in communication (c10d, gloo, NCCL) against the rest. ``profile.memory=true``
adds, on CUDA, the allocator's history of the window (``memory_rank<R>.pickle``, for
https://pytorch.org/memory_viz) and a snapshot when a step runs out of memory
(``profile/oom_rank<R>.pickle``), and prints each rank's measured peak next to the planner's
prediction. On CPU there are no allocator snapshots; the trace records memory per operator instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from parallel3d.base import GIB, RunError
from parallel3d.config.schema import Config
from parallel3d.observe.metrics import max_memory_bytes
from parallel3d.runtime.failures import ensure_rank_log

# Operator names of collectives and point-to-point transfers, as the profiler records them.
COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")
HISTORY_ENTRIES = 100_000  # allocator events kept: enough for a few steps of a large model


def is_communication(name: str) -> bool:
    return name.startswith(COMM_PREFIXES) or "nccl" in name.lower()


class StepProfiler:
    """Starts the profiler before step a, stops it after step b; dumps memory on out-of-memory.
    ``say`` prints a line (rank 0's console); the other ranks' lines go to their logs. With
    ``profile.memory``, ``planned_peaks()`` gives the planner's peak bytes of each pipeline rank, asked
    only then (the planner sits above what it observes)."""

    def __init__(self, c: Config, run_dir: Path, rank: int, world_size: int, device: torch.device,
                 say: Callable[[str], None], planned_peaks: Callable[[], list[int]] = list):
        self.c, self.rank, self.world_size, self.device = c, rank, world_size, device
        self.planned_peaks = planned_peaks
        self.say, self.log_file = say, ensure_rank_log(run_dir, rank) if rank else None
        self.first, self.last = (c.profile.steps or [0, -1])
        self.here = bool(c.profile.steps) and (c.profile.ranks is None or rank in c.profile.ranks)
        self.folder = run_dir / "profile"
        self.snapshots = c.profile.memory and device.type == "cuda"
        self.profiler: profile | None = None
        if c.profile.memory and device.type != "cuda" and rank == 0:
            say("parallel3d: profile.memory on CPU: no CUDA memory snapshots (the allocator's history is CUDA's); "
                "the trace records each operator's memory, and the peak below is the process's resident size")

    def step_begins(self, step: int) -> None:
        if step == self.first and self.here:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            p = self.c.profile
            self.profiler = profile(activities=activities, record_shapes=p.record_shapes, with_stack=p.with_stack,
                                    profile_memory=p.memory)
            if self.snapshots:
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
            self.profiler.start()

    def step_ends(self, step: int) -> None:
        if step != self.last:
            return
        if self.profiler is not None:
            self.profiler.stop()
            window = self.folder / f"step{self.first}"
            window.mkdir(parents=True, exist_ok=True)
            trace = window / f"rank{self.rank}.json"
            self.profiler.export_chrome_trace(str(trace))
            if self.snapshots:
                torch.cuda.memory._dump_snapshot(str(window / f"memory_rank{self.rank}.pickle"))
                torch.cuda.memory._record_memory_history(enabled=None)
            self.report(summary(self.profiler, self.last - self.first + 1, self.c.profile.top_ops, trace))
            self.profiler = None
        if self.c.profile.memory:  # every rank takes part: the peaks are gathered
            self.compare_peaks()

    def report(self, lines: list[str]) -> None:
        if self.log_file is None:
            for line in lines:
                self.say(line)
        else:
            with open(self.log_file, "a") as f:
                f.write("".join(line + "\n" for line in lines))

    def compare_peaks(self) -> None:
        """Each rank's measured peak beside the planner's prediction for its pipeline rank."""
        peak = torch.tensor([float(max_memory_bytes(self.device))], dtype=torch.float64, device=self.device)
        peaks = [peak.clone() for _ in range(self.world_size)]
        if dist.is_initialized():
            dist.all_gather(peaks, peak)
        if self.rank != 0:
            return
        planned = self.planned_peaks()
        per_pp = len(peaks) // len(planned)
        what = "allocator peak" if self.device.type == "cuda" else "resident set size (the whole process)"
        for r, measured in enumerate(peaks):
            predicted = planned[r // per_pp]
            self.say(f"parallel3d: memory: rank {r} measured {measured.item() / GIB:.3f} GiB ({what}), "
                     f"planner predicted {predicted / GIB:.3f} GiB")

    def out_of_memory(self, step: int) -> RunError:
        """The error to raise instead: one line, naming the snapshot written when profile.memory is on."""
        message = f"rank {self.rank} ran out of GPU memory at step {step}"
        if not self.snapshots:
            return RunError(f"{message}. Fix: set profile.memory=true and profile.steps=[{step}, {step}] to record "
                            f"what held the memory, or see docs/planner.md for a layout that fits")
        if self.profiler is None:  # the allocator's history was not being recorded: this is what is left
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"oom_rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return RunError(f"{message}; the allocator's snapshot is {path}. Fix: open it at "
                        f"https://pytorch.org/memory_viz and see docs/planner.md for a layout that fits")


def summary(prof: profile, steps: int, top: int, trace: Path) -> list[str]:
    """Top operators by self time, and communication against the rest, per step."""
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    cuda = any(e.self_device_time_total for e in events)
    self_us = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    comm = sum(self_us(e) for e in events if is_communication(e.key))
    rest = sum(self_us(e) for e in events if not is_communication(e.key))
    where = "GPU" if cuda else "CPU"
    lines = [f"parallel3d: profile: {trace} ({steps} steps): per step {comm / steps / 1e3:.1f} ms in communication, "
             f"{rest / steps / 1e3:.1f} ms in other operators ({where} self time)"]
    for e in sorted(events, key=self_us, reverse=True)[:top]:
        lines.append(f"parallel3d: profile:   {self_us(e) / steps / 1e3:9.2f} ms/step  {e.count // steps:6d} calls/step"
                     f"  {e.key}")
    return lines
