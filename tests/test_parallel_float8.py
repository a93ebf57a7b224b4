"""Float8 training (torchao, emulated on the CPU): which layers convert, how they compose with
tensor and data parallelism, and that training tracks bf16 in one process, ZeRO-3 and tp2.

Tolerance: float8 vs bf16, relative loss difference per step over the 10 FAST steps, below 1e-2
(the issue's target for the final loss), about 3x what the layouts show with every block linear
in float8 (tensorwise; the table in docs/float8.md). Not a round-off bound (float8's quantization
is the difference measured), so not derived from a twin as the parity tests' are
(tests/harness/tolerance.py).
In one process bf16 and float8 run the same code but for the float8 layers, so there they must
also differ (above 1e-4): float8 is really on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torchao.float8  # noqa: F401  (pyproject's dev extra: missing, this file fails, not skips)
from harness.parity import Matrix, assert_matches, layouts, prefetch_selected, selected_params
from harness.runs import relative_error
from omegaconf import OmegaConf
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.testing._internal.distributed.fake_pg import FakeStore

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.models import Transformer
from parallel3d.parallel.data import DataParallelPlan, apply_data_parallel
from parallel3d.parallel.float8 import Float8Plan, apply_float8, float8_block_plan, is_float8
from parallel3d.parallel.mesh import ParallelDims, build_mesh
from parallel3d.parallel.tensor import apply_tensor_parallel, block_plan
from parallel3d.validate import check

TOLERANCE = 1e-2
FLOAT8 = ["train.float8=tensorwise", "train.float8_skip_small=false", "train.param_dtype=bfloat16"]
BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                 "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def cpu_plan(train) -> Float8Plan:
    """The float8 plan of ``train`` on this machine's CPU (emulated matmuls)."""
    return Float8Plan(train.float8, train.float8_skip_small, train.float8_fsdp_all_gather, "cpu")


def meta_model(overrides: list[str]):
    cfg = compose(overrides)
    with torch.device("meta"):
        return Transformer(OmegaConf.to_object(cfg.model)), cfg.train


def converted(overrides: list[str]) -> list[str]:
    model, train = meta_model(overrides)
    names = apply_float8(model, cpu_plan(train))
    assert names == [fqn for fqn, m in model.named_modules() if is_float8(m)]  # reported = done
    return names


@pytest.mark.fast
def test_block_linears_convert_and_the_head_does_not():
    names = converted(FLOAT8)
    assert names == [f"layers.{i}.{layer}" for i in range(4) for layer in BLOCK_LINEARS]


def test_moe_routers_stay_in_high_precision():
    """The router's scores choose the experts (and under tp it multiplies with its weight itself)."""
    names = converted([*FLOAT8, "model=tiny_moe", "model.moe.shared_experts=1"])
    assert not any(name.endswith("router.gate") for name in names)
    assert "layers.0.feed_forward.shared.w1" in names


def test_dims_not_divisible_by_16_are_skipped():
    names = converted([*FLOAT8, "model.ffn_dim=200"])  # w1/w3 make 200 outputs, w2 takes 200 inputs
    assert names == [f"layers.{i}.attention.{w}" for i in range(4) for w in ("wq", "wk", "wv", "wo")]


def test_small_layers_are_skipped_by_default():
    """torchao's H100 table: the tiny model has no layer worth float8; a 1B-shaped block keeps its
    small k/v projections (2048 -> 512) in bf16 under tensorwise, and rowwise skips the 2048-wide ones."""
    assert converted(["train.float8=tensorwise"]) == []
    shape = ["model.dim=2048", "model.n_heads=32", "model.n_kv_heads=8", "model.ffn_dim=8192",
             "model.n_layers=1", "model.vocab_size=128256"]
    tensorwise = converted(["train.float8=tensorwise", *shape])
    assert tensorwise == [f"layers.0.{w}" for w in ("attention.wq", "attention.wo", "feed_forward.w1",
                                                     "feed_forward.w2", "feed_forward.w3")]
    assert converted(["train.float8=rowwise", *shape]) == [f"layers.0.feed_forward.{w}" for w in ("w1", "w3")]


def test_none_converts_nothing():
    assert converted(["train.float8=none", "train.float8_skip_small=false"]) == []


def test_rowwise_trains_close_to_float32_in_one_process():
    """Rowwise (axiswise scales, power-of-2) runs forward and backward emulated, near float32.
    Gradients: about the relative error e4m3's 3 mantissa bits give (unit roundoff 2^-4 = 6.25%;
    docs/float8.md) on the output gradients every matmul's backward takes in float8."""
    model, train = meta_model(["train.float8=rowwise", "train.float8_skip_small=false"])
    reference, _ = meta_model([])
    for m in (model, reference):
        m.to_empty(device="cpu")
        m.init_weights(0)
    apply_float8(model, cpu_plan(train))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (model, reference):
        loss = torch.nn.functional.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (model, reference)]
    assert 0 < relative_error(losses[:1], losses[1:]) < 1e-3, losses
    assert (grads[0] - grads[1]).norm() / grads[1].norm() < 0.15


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_tensorwise_layers_get_float8_tensor_parallel_styles(fake_world):
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)

    model, train = meta_model([*FLOAT8, "model.ffn_dim=200"])  # feed_forward stays bf16
    apply_float8(model, cpu_plan(train))
    block = model.layers["0"]
    plan = float8_block_plan(block, block_plan(sequence_parallel=True))
    assert {k: type(v) for k, v in plan.items() if k.split(".")[0] == "attention"} == {
        "attention": PrepareFloat8ModuleInput, "attention.wq": Float8ColwiseParallel,
        "attention.wk": Float8ColwiseParallel, "attention.wv": Float8ColwiseParallel,
        "attention.wo": Float8RowwiseParallel}
    assert type(plan["feed_forward.w1"]) is ColwiseParallel and type(plan["feed_forward.w2"]) is RowwiseParallel
    assert plan["attention.wo"].output_layouts == block_plan(True)["attention.wo"].output_layouts
    tp = build_mesh(ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=1), "cpu").tp
    apply_tensor_parallel(model, tp, sequence_parallel=True, float8=True)  # torchao accepts the plan


def test_rowwise_layers_keep_torch_tensor_parallel_styles():
    model, train = meta_model(["train.float8=rowwise", "train.float8_skip_small=false"])
    apply_float8(model, cpu_plan(train))
    plan = block_plan(sequence_parallel=True)
    assert {k: type(v) for k, v in float8_block_plan(model.layers["0"], plan).items()} == \
        {k: type(v) for k, v in plan.items()}


def test_fsdp_float8_all_gather_wraps_the_float8_weights(fake_world):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model, train = meta_model([*FLOAT8, "train.float8_fsdp_all_gather=true"])
    apply_float8(model, cpu_plan(train))
    dp = build_mesh(ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1), "cpu").dp
    apply_data_parallel(model, dp, dp, DataParallelPlan(zero_stage=3, param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32))
    kinds = {name: isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor)
             for name, p in model.named_parameters()}
    assert {name for name, is_f8 in kinds.items() if is_f8} == {f"layers.{i}.{w}.weight" for i in range(4)
                                                                  for w in BLOCK_LINEARS}


@pytest.mark.parametrize("overrides,world_size,key,words", [
    (["train.float8=fp8"], 1, "train.float8", "unknown float8 recipe"),
    (["train.float8=rowwise", "train.float8_fsdp_all_gather=true"], 2, "train.float8_fsdp_all_gather",
     "one scale per tensor"),
    (["train.float8=tensorwise", "train.float8_fsdp_all_gather=true"], 1, "train.float8_fsdp_all_gather",
     "no FSDP all-gather"),
    (["train.float8=tensorwise", "train.float8_fsdp_all_gather=true", "parallel.zero_stage=0"], 2,
     "train.float8_fsdp_all_gather", "no FSDP all-gather"),
    (["train.float8_fsdp_all_gather=true"], 2, "train.float8_fsdp_all_gather", "converts no layer"),
])
def test_refused_with_key_and_fix(overrides, world_size, key, words):
    with pytest.raises(ConfigError, match=words) as err:
        check(compose(overrides), world_size)
    assert str(err.value).startswith(f"{key}=") and "Fix: " in str(err.value) and "\n" not in str(err.value)


def test_refused_when_torchao_is_missing(monkeypatch):
    import parallel3d.parallel.float8 as float8

    monkeypatch.setattr(float8, "torchao_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^train\.float8=tensorwise: .*pip install 'parallel3d\[float8\]'"):
        check(compose(["train.float8=tensorwise"]), 1)


# name: (ranks, overrides)
LAYOUTS = layouts({
    "float8": (1, [*FLOAT8, "train.micro_batch_size=16"]),
    "float8-zero3": (2, [*FLOAT8, "parallel.zero_stage=3", "train.float8_fsdp_all_gather=true",
                         "train.micro_batch_size=8"]),
    "float8-tp2": (2, [*FLOAT8, "parallel.tp=2", "train.micro_batch_size=16"]),
    "float8-pp2": (2, [*FLOAT8, "parallel.pp=2", "train.micro_batch_size=2"]),  # each stage converts its blocks
})
MATRIX = Matrix(tuple(LAYOUTS))  # lent to other files' batches (harness/parity.py)


BF16 = ("bf16", 1, ["train.param_dtype=bfloat16", "train.micro_batch_size=16"])  # what every layout tracks


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py),
    the bf16 run in the one-process float8 run's launch."""
    if selected_params(request, "layout"):
        name, nproc, overrides = BF16
        prefetch_selected(request, parity, MATRIX, also={name: (nproc, overrides)})


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_float8_tracks_bf16(layout, parity):
    """Through parity.run, which also holds the planner's model-state bytes to the measured ones:
    float8 keeps float32 master weights, gradients and optimizer state, so the planner needs no change."""
    bf16 = parity.run(*BF16)
    run = parity.train(layout)
    assert_matches(bf16, run, tolerance=TOLERANCE, metrics=("loss",))
    if layout.nproc == 1:  # the same code path as bf16 but for the float8 layers
        assert relative_error(run.losses, bf16.losses) > 1e-4, (run.losses, bf16.losses)
