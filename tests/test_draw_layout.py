"""tools/draw_layout.py: the picture shows the real mesh and torch's real schedule."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from draw_layout import DURATION, rank_grid, schedule_actions, timeline  # noqa: E402

from parallel3d.parallel.mesh import ParallelDims, build_mesh  # noqa: E402

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.fast
def test_rank_grid_is_the_device_mesh():
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = build_mesh(ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=2), "cpu").world.mesh
    finally:
        dist.destroy_process_group()
    assert {int(mesh[p, d, t]): (p, d, t) for p in range(2) for d in range(2) for t in range(2)} == rank_grid(2, 2, 2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_timeline_runs_every_microbatch_through_every_stage_in_dependency_order(schedule):
    pp, microbatches = 2, 4
    per_rank = 1 if schedule in ("GPipe", "1F1B") else 2
    stages = pp * per_rank
    placed = timeline(schedule_actions(schedule, pp, microbatches, per_rank), stages)
    end = {}
    for rank in placed:
        busy_until = 0
        for kind, stage, mb, start in rank:
            assert start >= busy_until  # one action at a time per rank
            busy_until = start + DURATION[kind]
            end[(kind, stage, mb)] = busy_until
    for stage in range(stages):
        for mb in range(microbatches):
            assert ("F", stage, mb) in end
            backward = ("B", stage, mb) if ("B", stage, mb) in end else ("I", stage, mb)
            assert backward in end
            if stage:  # a forward starts after the previous stage's forward ended
                start = next(s for r in placed for k, st, m, s in r if (k, st, m) == ("F", stage, mb))
                assert start >= end[("F", stage - 1, mb)]


def test_cli_writes_a_png(tmp_path):
    out = tmp_path / "layout.png"
    proc = subprocess.run([sys.executable, "tools/draw_layout.py", "--dp", "2", "--tp", "2", "--pp", "2",
                           "--schedule", "Interleaved1F1B", "--microbatches", "4", "--output", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
