"""Multi-head latent attention and DeepSeek-V3's MoE (model=tiny_mla) under every parallelism: each
layout trains 10 steps to the losses, gradient norms and final weights of one process, with
document masking on; the planner's model-state bytes are exact (``Parity.run``). One launch of 4
ranks trains them all (tests/layout_batch.py)."""

from __future__ import annotations

import pytest
from conftest import assert_matches, layouts, prefetch_selected

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.validate import check

# At the default lr (3e-3) the tiny MoE's tenth step amplifies float rounding (1e-8) past 1e-5 in
# the grad norm of some layouts; at 1e-3 every layout stays within 1e-7 of one process.
MLA = ["model=tiny_mla", "data.document_masking=true", "optim.lr=1e-3"]

LAYOUTS = layouts({  # name: (ranks, overrides)
    # heads split over tp, the latent down-projections and their norms replicated (parallel/tensor.py)
    "dp2-tp2": (4, ["parallel.tp=2", "train.micro_batch_size=8"]),
    "dp2-pp2": (4, ["parallel.pp=2", "model.activation_checkpoint=full"]),
    "dp2-cp2-alltoall": (4, ["parallel.cp=2", "parallel.cp_method=alltoall", "train.micro_batch_size=8"]),
    "dp2-cp2-ring": (4, ["parallel.cp=2", "parallel.cp_method=ring", "train.micro_batch_size=8"]),
    "ep2-dp4": (4, ["parallel.ep=2"]),
})


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    prefetch_selected(request, parity, LAYOUTS, prefix="mla-", extra=MLA)


@pytest.fixture(scope="module")
def mla_reference(parity):
    return parity.run("mla-reference", 1, [*MLA, "train.micro_batch_size=16"])


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_mla_layout_trains_like_one_process(parity, mla_reference, layout):
    run = parity.train(layout, prefix="mla-", extra=MLA)
    assert_matches(mla_reference, run, rel=1e-5, weights=True)


def test_mla_refuses_what_it_lacks():
    with pytest.raises(ConfigError, match="model.qk_norm"):
        check(compose(["model=tiny_mla", "model.qk_norm=true", "run_dir=/nonexistent"]), 1)
    with pytest.raises(ConfigError, match="model.moe.topk_group"):
        check(compose(["model=tiny_mla", "model.moe.topk_group=5", "run_dir=/nonexistent"]), 1)
