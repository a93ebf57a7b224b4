"""dp2 x pp2: every pipeline schedule with DDP (ZeRO-0) and with ZeRO-3 trains to the
single-process numbers, and ZeRO-1 and ZeRO-2 do under 1F1B. (Zero-bubble schedules with ZeRO-3
once trained to wrong numbers, while ZeRO-3 resharded parameters after each forward under pp.)
Under pp the three sharded stages are one FSDP configuration at dp2 (parallel/data.py: no reshard
after forward, gradients reduced once per schedule step, the same dp_shard ranks), so ZeRO-1 and -2
under the other five schedules would train ZeRO-3's run again; 1F1B keeps their configuration and
the planner's bytes for them proved. Apart from tests/test_parallel_pipeline.py so that the two
matrices can run side by side under pytest-xdist."""

from __future__ import annotations

import pytest
from harness.parity import Matrix, layouts, prefetch_selected

from parallel3d.parallel.pipeline import SCHEDULES

LAYOUTS = layouts({f"dp2-pp2-{s}-zero{z}": (4, ["parallel.pp=2", f"parallel.pp_schedule={s}",
                                                f"parallel.zero_stage={z}", "train.micro_batch_size=2"])
                   for s in SCHEDULES for z in range(4) if z in (0, 3) or s == "1F1B"})
MATRIX = Matrix(tuple(LAYOUTS))  # lent to other files' batches (harness/parity.py)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, MATRIX)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_schedule_with_ddp_and_zero3_matches_single_process(layout, parity):
    parity.assert_same_training(parity.train(layout))
