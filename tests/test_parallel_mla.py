"""Multi-head latent attention and DeepSeek-V3's MoE (model=tiny_mla) under every parallelism: each
layout trains the parity runs' steps to the losses, gradient norms and final weights of one process, with
document masking on; the planner's model-state bytes are exact (``Parity.run``). One launch of 4
ranks trains them all (tests/harness/layout_batch.py)."""

from __future__ import annotations

import pytest
from harness.parity import Matrix, assert_matches, layouts, prefetch_selected

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.validate import check

# lr 1e-3, not the default 3e-3: there the tiny MoE's later steps amplify float rounding far more
# (a routing choice near a tie, docs/moe.md), and the tolerance its own sensitivity implies would be
# much wider (tests/harness/tolerance.py).
MLA = ["model=tiny_mla", "data.document_masking=true", "optim.lr=1e-3"]
REFERENCE = ("mla-reference", [*MLA, "train.micro_batch_size=16"])  # one process (and its twins)

LAYOUTS = layouts({  # name: (ranks, overrides)
    # heads split over tp, the latent down-projections and their norms replicated (parallel/tensor.py)
    "dp2-tp2": (4, ["parallel.tp=2", "train.micro_batch_size=8"]),
    "dp2-pp2": (4, ["parallel.pp=2", "model.activation_checkpoint=full"]),
    "dp2-cp2-alltoall": (4, ["parallel.cp=2", "parallel.cp_method=alltoall", "train.micro_batch_size=8"]),
    "dp2-cp2-ring": (4, ["parallel.cp=2", "parallel.cp_method=ring", "train.micro_batch_size=8"]),
    "ep2-dp4": (4, ["parallel.ep=2", "train.micro_batch_size=2"]),  # accumulating, as at dp2
})
MATRIX = Matrix(tuple(LAYOUTS), prefix="mla-", extra=tuple(MLA))  # lent to other files' batches (harness/parity.py)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    prefetch_selected(request, parity, MATRIX)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_mla_layout_trains_like_one_process(parity, layout):
    """Losses, grad norms and final weights within what the one-process run's sensitivity implies."""
    reference, tolerance = parity.measured(*REFERENCE)
    assert_matches(reference, parity.train(layout, prefix="mla-", extra=MLA), tolerance=tolerance, weights=True)


@pytest.mark.fast
def test_mla_refuses_what_it_lacks():
    with pytest.raises(ConfigError, match="model.qk_norm"):
        check(compose(["model=tiny_mla", "model.qk_norm=true", "run_dir=/nonexistent"]), 1)
    with pytest.raises(ConfigError, match="model.moe.topk_group"):
        check(compose(["model=tiny_mla", "model.moe.topk_group=5", "run_dir=/nonexistent"]), 1)
