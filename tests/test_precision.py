"""One precision policy in every layout (``parallel/data.py``, Precision; docs/parallelism.md).

In bf16 every layout, one process included, trains under FSDP's mixed-precision policy (a mesh
of one rank where there is no data parallelism): float32 master weights, the whole model computing
in bf16, gradients reduced and accumulated in ``train.reduce_dtype``. The parity runs below hold
each layout to one process over 10 steps. Before this policy one process trained under autocast
(float32 residual stream) and data-parallel layouts under FSDP's cast: 4.8e-4 apart at dp2, which
the 1e-4 here refuses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import assert_matches, layouts, prefetch_selected
from omegaconf import OmegaConf
from torch.distributed.fsdp import FSDPModule

from parallel3d.config.compose import compose
from parallel3d.step import build_setup
from parallel3d.validate import check

BF16 = ["train.param_dtype=bfloat16"]
# Data- and pipeline-parallel layouts, losses: the bound. bf16 keeps 8 bits of mantissa,
# so a different float32 summation order anywhere (reduce-scatter, micro-batch accumulation) moves
# a master weight by an ulp that can flip its bf16 copy. The layouts' differences from one process
# (docs/parallelism.md, "Precision") sit below these bounds with room for another CPU's kernels.
DATA_PIPELINE = (1e-4, 1e-3)  # (losses, grad norms), relative, every step
# Tensor parallelism also splits each matmul's reduction: row-parallel wo and w2 sum bf16 partial
# products over the tp ranks, a second bf16 rounding: up to about one bf16 ulp (2**-8 = 3.9e-3) in
# grad norm.
TENSOR = (2.5e-4, 1e-2)
# All-to-all context parallelism computes its projections on 16 half sequences per rank (the rows of
# one process at micro batch 8) and its attention on whole sequences (as at micro batch 16): no one
# process computes those shapes together. Where the CPU's bf16 kernels round by shape, one process
# itself moves between micro batches 8 and 16 in grad norm, and cp2 lands near either of the two.
# Its losses keep the data-parallel bound; its grad norms get that spread.
CONTEXT = (1e-4, 2.5e-3)

TABLE = {  # name: (ranks, overrides, tolerances); the largest micro batch each layout allows
    "bf16-zero0-dp2": (2, [*BF16, "parallel.dp_shard=2", "parallel.zero_stage=0", "train.micro_batch_size=8"],
                       DATA_PIPELINE),
    # two micro batches per rank: ZeRO-1 accumulates unsharded gradients (reduce dtype) between them
    "bf16-zero1-dp2": (2, [*BF16, "parallel.dp_shard=2", "parallel.zero_stage=1", "train.micro_batch_size=4"],
                       DATA_PIPELINE),
    "bf16-zero3-dp2": (2, [*BF16, "parallel.dp_shard=2", "parallel.zero_stage=3", "train.micro_batch_size=8"],
                       DATA_PIPELINE),
    "bf16-pp2": (2, [*BF16, "parallel.pp=2", "train.micro_batch_size=8"], DATA_PIPELINE),
    "bf16-zero2-dp2-pp2": (4, [*BF16, "parallel.dp_shard=2", "parallel.pp=2", "parallel.zero_stage=2",
                               "train.micro_batch_size=4"], DATA_PIPELINE),
    # all-to-all cp: each rank attends whole sequences for half the heads; gradients reduce as dp's
    "bf16-cp2": (2, [*BF16, "parallel.cp=2", "train.micro_batch_size=16"], CONTEXT),
    "bf16-tp2": (2, [*BF16, "parallel.tp=2", "train.micro_batch_size=16"], TENSOR),
}
LAYOUTS = layouts({name: (nproc, overrides) for name, (nproc, overrides, _) in TABLE.items()})
TOLERANCES = {name: tolerances for name, (_, _, tolerances) in TABLE.items()}  # (loss, grad norm)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/layout_batch.py),
    the one-process references in one more."""
    prefetch_selected(request, parity, LAYOUTS)
    parity.prefetch({name: (1, [*BF16, f"train.micro_batch_size={m}"]) for m, name in REFERENCES.items()})


REFERENCES = {16: "bf16", 8: "bf16-micro8", 4: "bf16-micro4"}  # micro batch size: one-process run


def bf16_reference(parity, micro_batch_size: int = 16):
    """One process with the layout's micro batch size (16: the whole batch in one micro batch, the
    same run as test_parallel_float8's). In bf16 the micro batch size alone moves the losses of one
    process on CPUs whose bf16 matmul kernels block their float32 sums by the matrix shape (by as
    much as a layout differs: docs/parallelism.md, "Precision"). Each layout is held to one process
    computing the same shapes."""
    return parity.run(REFERENCES[micro_batch_size], 1, [*BF16, f"train.micro_batch_size={micro_batch_size}"])


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bf16_layout_computes_what_one_process_computes(layout, parity):
    """Through parity.run, which also holds the planner's model-state bytes to the measured ones
    (float32 masters in every layout)."""
    loss_tolerance, norm_tolerance = TOLERANCES[layout.name]
    micro_batch_size = int(next(o for o in layout.overrides if o.startswith("train.micro_batch_size=")).split("=")[1])
    reference, run = bf16_reference(parity, micro_batch_size), parity.train(layout)
    assert_matches(reference, run, rel=loss_tolerance, metrics=("loss",))
    assert_matches(reference, run, rel=norm_tolerance, metrics=("grad_norm",))


def _one_process_setup(param_dtype: str):
    cfg = check(compose(["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=16",
                         f"train.param_dtype={param_dtype}", "run_dir=/nonexistent"]), 1)
    return build_setup(OmegaConf.to_object(cfg), torch.device("cpu"))


def test_one_process_in_bf16_casts_as_fsdp_does_and_keeps_float32_masters():
    try:
        setup = _one_process_setup("bfloat16")
        assert setup.meshes.precision is not None and setup.meshes.precision.size() == 1
        assert setup.meshes.dp is None and setup.meshes.dp_cp is None  # no data parallelism to account for
        assert isinstance(setup.model, FSDPModule) and isinstance(setup.model.layers["0"], FSDPModule)
        assert {p.dtype for p in setup.model.parameters()} == {torch.float32}
        logits = setup.model(torch.zeros(2, 16, dtype=torch.long))
        assert logits.dtype == torch.bfloat16  # the whole model computes in bf16, the output included
    finally:
        if dist.is_initialized():  # build_mesh started a group of one rank for FSDP
            dist.destroy_process_group()


def test_one_process_in_float32_runs_without_a_wrapper_or_process_group():
    setup = _one_process_setup("float32")
    assert setup.meshes.world is None and not dist.is_initialized()
    assert not isinstance(setup.model, FSDPModule)
