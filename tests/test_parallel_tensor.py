"""Tensor parallelism alone and under every data-parallel mode trains to the single-process numbers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness.parity import Matrix, layouts, prefetch_selected
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel3d.config.compose import compose
from parallel3d.models import Transformer
from parallel3d.parallel.mesh import ParallelDims, build_mesh
from parallel3d.parallel.tensor import apply_tensor_parallel

# name: (ranks, overrides, tied)
LAYOUTS = layouts({
    "tp2": (2, ["parallel.tp=2", "train.micro_batch_size=16"], False),
    "tp2-no-sp-accum": (2, ["parallel.tp=2", "parallel.sequence_parallel=false", "train.micro_batch_size=4"], False),
    "tp2-tied": (2, ["parallel.tp=2", "model.tie_embeddings=true", "train.micro_batch_size=8"], True),
    "dp2-tp2-zero0": (4, ["parallel.tp=2", "parallel.zero_stage=0", "train.micro_batch_size=8"], False),
    "dp2-tp2-zero1-accum": (4, ["parallel.tp=2", "parallel.zero_stage=1", "train.micro_batch_size=4"], False),
    "dp2-tp2-zero2": (4, ["parallel.tp=2", "parallel.zero_stage=2", "train.micro_batch_size=8"], False),
    "dp2-tp2-zero3-accum": (4, ["parallel.tp=2", "parallel.zero_stage=3", "train.micro_batch_size=4"], False),
    "hsdp2x2-tp2-zero3": (8, ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.zero_stage=3",
                              "train.micro_batch_size=4"], False),
})
MATRIX = Matrix(tuple(LAYOUTS))  # lent to other files' batches (harness/parity.py)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, MATRIX)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout, parity):
    parity.assert_same_training(parity.train(layout), tied=layout.tied)


@pytest.fixture
def tp_world():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield build_mesh(ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=1), "cpu").tp
    finally:
        dist.destroy_process_group()


@pytest.mark.fast
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_plan_splits_each_layer_as_documented(tp_world, sequence_parallel):
    with torch.device("meta"):
        model = Transformer(OmegaConf.to_object(compose([]).model))
    apply_tensor_parallel(model, tp_world, sequence_parallel)
    placements = {name: p.placements for name, p in model.named_parameters() if isinstance(p, DTensor)}
    block = "layers.0."
    for colwise in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        assert placements[f"{block}{colwise}.weight"] == (Shard(0),)  # out features split: heads / hidden units
    for rowwise in ("attention.wo", "feed_forward.w2"):
        assert placements[f"{block}{rowwise}.weight"] == (Shard(1),)  # in features split: partial sums
    assert placements["tok_embeddings.weight"] == (Shard(1),)  # embedding dim split: no vocab-sized gradient
    assert placements["output.weight"] == (Shard(0),)  # vocabulary split: loss parallel
    norms = {f"{block}attention_norm.weight", f"{block}ffn_norm.weight", "norm.weight"}
    assert all(placements[n] == (Replicate(),) for n in norms)  # on a split or a whole sequence
    # Every parameter is a DTensor, so the optimizer's multi-tensor kernels can take them all.
    assert placements.keys() == {name for name, _ in model.named_parameters()}
    with torch.device("meta"):
        tied = Transformer(OmegaConf.to_object(compose(["model.tie_embeddings=true"]).model))
    apply_tensor_parallel(tied, tp_world, sequence_parallel)
    assert tied.tok_embeddings.weight.placements == (Shard(0),)  # it is the output projection too
