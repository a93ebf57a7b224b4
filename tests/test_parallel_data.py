"""Every data-parallel mode trains to the single-process numbers, with the memory it promises.

One torchrun per layout; each layout's run serves both the parity and the memory assertions.
Global batch 16 in every run; micro batches below the per-rank batch turn on accumulation.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness.parity import Matrix, layouts, prefetch_selected
from harness.runs import final_weights
from omegaconf import OmegaConf
from torch.distributed.fsdp import FSDPModule
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel3d.config.compose import compose
from parallel3d.models import Transformer
from parallel3d.parallel.data import DataParallelPlan, apply_data_parallel
from parallel3d.parallel.mesh import ParallelDims, build_mesh

# name: (ranks, overrides). Each ZeRO stage appears with and without gradient accumulation.
LAYOUTS = layouts({
    "dp2-zero0": (2, ["parallel.zero_stage=0", "train.micro_batch_size=8"]),
    "dp2-zero1-accum": (2, ["parallel.zero_stage=1", "train.micro_batch_size=4"]),
    "dp2-zero2": (2, ["parallel.zero_stage=2", "train.micro_batch_size=8"]),
    "dp2-zero3-accum": (2, ["parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "dp4-zero0-accum": (4, ["parallel.zero_stage=0", "train.micro_batch_size=2"]),
    "dp4-zero1": (4, ["parallel.zero_stage=1", "train.micro_batch_size=4"]),
    "dp4-zero2-accum": (4, ["parallel.zero_stage=2", "train.micro_batch_size=2"]),
    "dp4-zero3": (4, ["parallel.zero_stage=3", "train.micro_batch_size=4"]),
    "hsdp2x2-zero2": (4, ["parallel.dp_replicate=2", "parallel.zero_stage=2", "train.micro_batch_size=4"]),
    "hsdp2x2-zero3-accum": (4, ["parallel.dp_replicate=2", "parallel.fsdp_sharding_strategy=HYBRID_SHARD",
                                "train.micro_batch_size=2"]),
    "dp2-zero3-prefetch2": (2, ["parallel.zero_stage=3", "parallel.fsdp_prefetch=2", "train.micro_batch_size=8"]),
    "dp2-zero3-sizewrap": (2, ["parallel.zero_stage=3", "parallel.fsdp_wrap=size", "parallel.fsdp_min_params=100000",
                               "train.micro_batch_size=8"]),
})
MATRIX = Matrix(tuple(LAYOUTS), param="layout_run")  # lent to other files' batches (harness/parity.py)

@pytest.fixture
def fake_world():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        yield build_mesh(ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1), "cpu")
    finally:
        dist.destroy_process_group()


@pytest.mark.fast
@pytest.mark.parametrize("wrap,units", [
    ("block", {"", "layers.0", "layers.1", "layers.2", "layers.3"}),
    # feed_forward (147k params) reaches 100k alone; attention (49k) and norms stay with the root.
    ("size", {"", "layers.0.feed_forward", "layers.1.feed_forward", "layers.2.feed_forward",
              "layers.3.feed_forward"}),
])
def test_wrap_policy_decides_the_fsdp_units(fake_world, wrap, units):
    with torch.device("meta"):
        model = Transformer(OmegaConf.to_object(compose([]).model))
    plan = DataParallelPlan(zero_stage=3, param_dtype=torch.float32, reduce_dtype=torch.float32, wrap=wrap,
                            min_params=100_000)
    apply_data_parallel(model, fake_world.dp, fake_world.fsdp, plan)
    assert {name for name, m in model.named_modules() if isinstance(m, FSDPModule)} == units


@pytest.mark.fast
def test_cpu_gathers_are_issued_a_block_ahead(fake_world, monkeypatch):
    """On a CPU device FSDP's all-gathers are asynchronous and prefetched in forward, the root
    starting the first block's and each block the next one's: when a block computes, its
    successor's parameters are already on their way (parallel/data.py, _overlap_gathers_on_host)."""
    with torch.device("meta"):
        model = Transformer(OmegaConf.to_object(compose([]).model))
    plan = DataParallelPlan(zero_stage=3, param_dtype=torch.float32, reduce_dtype=torch.float32)
    apply_data_parallel(model, fake_world.dp, fake_world.fsdp, plan)
    model.to_empty(device="cpu")
    model.init_weights(0)
    issued, started = [], []  # each gather's async_op; the gathers issued when each block starts
    # what FSDP calls for its gathers: all_gather_single in newer torch, all_gather_into_tensor before
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    gather = getattr(dist, name)

    def record(*args, async_op=False, **kwargs):
        issued.append(async_op)
        return gather(*args, async_op=async_op, **kwargs)

    monkeypatch.setattr(dist, name, record)
    blocks = list(model.layers.values())
    for block in blocks:  # after FSDP's own pre-forward hook, which runs first
        block.register_forward_pre_hook(lambda *_: started.append(len(issued)))
    model(torch.zeros(1, 8, dtype=torch.long))
    assert started == [min(i + 3, len(blocks) + 1) for i in range(len(blocks))]  # the root, blocks 0..i+1
    assert issued and all(issued)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, MATRIX)


@pytest.fixture(params=LAYOUTS, ids=str)
def layout_run(request, parity):
    return request.param, parity.train(request.param)


@pytest.mark.multirank
def test_losses_and_final_weights_match_single_process(layout_run, parity):
    parity.assert_same_training(layout_run[1])


def _ideal(reference: dict, stage: int, dp: int, dp_shard: int) -> dict:
    """Bytes per rank after a step if each stage divided exactly what it shards, over the ranks it
    shards over: ZeRO-1 all data-parallel ranks, ZeRO-2/3 dp_shard (what ZeRO-1/2 gather for the
    step is transient: it shows in the peak, not here)."""
    full = {k: reference[k] for k in ("param_bytes", "grad_bytes", "optim_state_bytes")}
    if stage == 0:
        return full
    return {k: v / (dp if stage == 1 else dp_shard) for k, v in full.items()}


@pytest.mark.multirank
def test_model_state_memory_is_ideal_for_the_zero_stage(layout_run, reference_run):
    layout, run = layout_run
    name, nproc = layout.name, layout.nproc
    stage = 3 if "zero3" in name else int(name.split("zero")[1][0])
    dp_shard = nproc // 2 if name.startswith("hsdp") else nproc
    measured, reference = run.metrics[0], reference_run.metrics[0]
    for key, ideal in _ideal(reference, stage, nproc, dp_shard).items():
        assert abs(measured[key] - ideal) / ideal < 0.02, f"{name} {key}: {measured[key]} vs ideal {ideal:.0f}"


@pytest.mark.multirank
def test_tied_embeddings_train_identically_under_fsdp(parity):
    run = parity.run("tied-dp2-zero3", 2, ["model.tie_embeddings=true", "parallel.zero_stage=3",
                                           "train.micro_batch_size=8"])
    parity.assert_same_training(run, tied=True)
    assert "lm_head.weight" not in final_weights(run.run_dir)  # one matrix, used twice
