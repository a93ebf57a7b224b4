"""One precision policy in every layout (``parallel/data.py``, Precision; docs/parallelism.md).

In bf16 every layout, one process included, trains under FSDP's mixed-precision policy (a mesh
of one rank where there is no data parallelism): float32 master weights, the whole model computing
in bf16, gradients reduced and accumulated in ``train.reduce_dtype``. The parity runs below hold
each layout to one process over the parity runs' steps, within what the one-process run's own sensitivity
implies (tests/harness/tolerance.py); the policy itself (what is cast where, float32 masters) is
checked directly by the tests at the end and by the planner's model-state bytes (``Parity.run``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness.parity import Matrix, assert_matches, layouts, prefetch_selected, selected_params
from omegaconf import OmegaConf
from harness.tolerance import measure
from torch.distributed.fsdp import FSDPModule

from parallel3d.config.compose import compose
from parallel3d.step import build_setup
from parallel3d.validate import check

# lr 3e-4, not the recipe's 3e-3. bf16 keeps 8 bits of mantissa, so any change of float32 summation
# order (reduce-scatter, micro-batch accumulation, another CPU's kernels) moves a master weight by
# an ulp that can flip its bf16 copy, and the flips compound. At 3e-4 fewer copies flip than at the
# recipe's lr: the grad norms' spread, and so their tolerance, is several times smaller
# (docs/parallelism.md, "Precision").
BF16 = ["train.param_dtype=bfloat16", "optim.lr=3e-4"]

TABLE = {  # name: (ranks, overrides); the largest micro batch each layout allows
    "bf16-zero0-dp2": (2, [*BF16, "parallel.dp_shard=2", "parallel.zero_stage=0", "train.micro_batch_size=8"]),
    # two micro batches per rank: ZeRO-1 accumulates unsharded gradients (reduce dtype) between them
    "bf16-zero1-dp2": (2, [*BF16, "parallel.dp_shard=2", "parallel.zero_stage=1", "train.micro_batch_size=4"]),
    "bf16-zero3-dp2": (2, [*BF16, "parallel.dp_shard=2", "parallel.zero_stage=3", "train.micro_batch_size=8"]),
    "bf16-pp2": (2, [*BF16, "parallel.pp=2", "train.micro_batch_size=8"]),
    "bf16-zero2-dp2-pp2": (4, [*BF16, "parallel.dp_shard=2", "parallel.pp=2", "parallel.zero_stage=2",
                               "train.micro_batch_size=4"]),
    # all-to-all cp: each rank attends whole sequences for half the heads; gradients reduce as dp's
    "bf16-cp2": (2, [*BF16, "parallel.cp=2", "train.micro_batch_size=16"]),
    # tp also splits each matmul's reduction: row-parallel wo and w2 sum bf16 partial products
    "bf16-tp2": (2, [*BF16, "parallel.tp=2", "train.micro_batch_size=16"]),
}
LAYOUTS = layouts(TABLE)
MATRIX = Matrix(tuple(LAYOUTS))  # lent to other files' batches (harness/parity.py)
# micro batch size: the one-process run. Each layout is held to one process computing the same
# shapes: on CPUs whose bf16 matmul kernels block their float32 sums by the matrix shape, dp2 at
# ZeRO-0 equals one process at its micro batch bit for bit.
REFERENCES = {16: "precision-micro16", 8: "precision-micro8", 4: "precision-micro4"}


def reference_overrides(micro_batch_size: int) -> list[str]:
    return [*BF16, f"train.micro_batch_size={micro_batch_size}"]


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py),
    the one-process references (and the twins of the first) in one more; none when no layout is
    selected (-k, -m fast: only the in-process tests)."""
    if not selected_params(request, "layout"):
        return
    prefetch_selected(request, parity, MATRIX)
    (m, name), *others = REFERENCES.items()
    parity.prefetch_references({name: reference_overrides(m)},
                               {other: reference_overrides(size) for size, other in others})


@pytest.fixture(scope="module")
def bf16_tolerance(parity):
    """One process's own spread in bf16: its twins (gradient noise) and the same run at the other
    micro batch sizes (another order of the same sums, in bf16 too). Gradient noise perturbs the
    float32 masters only; a layout also rounds bf16 products in other orders, as the micro batch
    size does, so the larger of the two spreads sets the tolerance."""
    (m, name), *others = REFERENCES.items()
    reference, tolerance = parity.measured(name, reference_overrides(m), metrics=("loss", "grad_norm"), weights=False)
    reordered = [parity.run(other, 1, reference_overrides(size)) for size, other in others]
    return tolerance.widened(measure(reference, *reordered, metrics=("loss", "grad_norm"), weights=False))


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bf16_layout_computes_what_one_process_computes(layout, parity, bf16_tolerance):
    """Through parity.run, which also holds the planner's model-state bytes to the measured ones
    (float32 masters in every layout)."""
    micro_batch_size = int(next(o for o in layout.overrides if o.startswith("train.micro_batch_size=")).split("=")[1])
    reference = parity.run(REFERENCES[micro_batch_size], 1, reference_overrides(micro_batch_size))
    assert_matches(reference, parity.train(layout), tolerance=bf16_tolerance, metrics=("loss", "grad_norm"))


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


@pytest.mark.fast
def test_one_process_in_float32_runs_without_a_wrapper_or_process_group():
    setup = _one_process_setup("float32")
    assert setup.meshes.world is None and not dist.is_initialized()
    assert not isinstance(setup.model, FSDPModule)
