"""Float8 training: torchao's float8 linear layers, applied before tensor and data parallelism.

``train.float8=tensorwise|rowwise`` swaps the transformer blocks' ``nn.Linear`` layers for
torchao's ``Float8Linear`` (``convert_to_float8_training``): each matmul casts its input, weight
and output gradient to float8 with dynamic scales (one per tensor, or one per row with power-of-2
scales) and accumulates in higher precision. The master weights, gradients and optimizer state
are unchanged (float32), so the model state a planner counts is the same as without float8.

Which linears are converted (``convert_filter``):
  - never the output head: the vocabulary projection feeds the loss, where float8's error costs
    most (torchtitan and torchao skip it as well);
  - never a MoE router (``router.gate``): its scores choose the experts;
  - never a layer whose dims are not multiples of 16 (``torch._scaled_mm`` requires it);
  - with ``train.float8_skip_small`` (default), not the layers torchao's H100 measurements say
    run slower in float8 (``torchao.float8._auto_filter_for_recipe``); every other layer of a
    small model would be skipped, so tests and small models turn it off.

How it composes (called by ``parallelize`` first, on the model still on the meta device):
  - tensor parallel: with tensorwise scaling the blocks use torchao's float8 TP styles
    (``Float8ColwiseParallel``/``Float8RowwiseParallel``/``PrepareFloat8ModuleInput``), which cast
    the activations to float8 before the sequence all-gather; rowwise keeps torch's styles (as
    torchtitan does: torchao has no rowwise float8 TP styles);
  - FSDP2: with ``train.float8_fsdp_all_gather`` (tensorwise only) the weights are all-gathered in
    float8 (half the bytes of bf16) with scales computed for all of them in one all-reduce after
    each optimizer step (``precompute_float8_scales``);
  - pipeline stages: each stage converts its own blocks; torch.compile compiles the converted
    blocks (fusing the casts into neighbouring kernels, which is where float8 pays off).

On a machine without float8 matmuls (the CPU, GPUs before sm_89) torchao emulates them
(``Float8LinearConfig(emulate=True)``): the values are rounded to float8 exactly as on a GPU and
multiplied in float32, so the numerics (and the losses tests compare) are float8's, not the speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from parallel3d.base import ConfigError, resolve_device

RECIPES = ("none", "tensorwise", "rowwise")
SKIPPED_MODULES = ("output",)  # fully qualified names never converted (the vocabulary head)
# MoE routers stay in high precision: their scores pick experts (torchtitan skips them too), and
# models.moe.Router multiplies with the weight directly (it may be a tp-replicated DTensor).
ROUTER = "router.gate"


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def needs_emulation(device_type: str) -> bool:
    """True where the hardware has no float8 matmul: the CPU and GPUs before compute capability 8.9."""
    return device_type != "cuda" or torch.cuda.get_device_capability() < (8, 9)


def linear_config(recipe: str, fsdp_all_gather: bool, emulate: bool):
    """torchao's ``Float8LinearConfig`` for ``recipe`` (tensorwise or rowwise)."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    # Float8LinearConfig checks its fields in __post_init__, which replace() runs again.
    return replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)


def convert_filter(recipe: str, skip_small: bool):
    """``(module, fqn) -> bool``: which linears become float8 (see the module docstring)."""
    from torchao.float8 import _auto_filter_for_recipe

    by_torchao = _auto_filter_for_recipe(recipe, filter_fqns=list(SKIPPED_MODULES))

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn in SKIPPED_MODULES or fqn.endswith(ROUTER):
            return False
        if skip_small:
            return by_torchao(module, fqn)
        out_features, in_features = module.weight.shape
        return out_features % 16 == 0 and in_features % 16 == 0

    return convert


@dataclass(frozen=True)
class Float8Plan:
    """What ``apply_float8`` reads: ``train.float8``, ``train.float8_skip_small``,
    ``train.float8_fsdp_all_gather``, and the device the matmuls run on (the CPU emulates them)."""

    recipe: str = "none"
    skip_small: bool = True
    fsdp_all_gather: bool = False
    device: str = "cpu"

    @classmethod
    def from_config(cls, train) -> "Float8Plan":
        return cls(train.float8, train.float8_skip_small, train.float8_fsdp_all_gather, resolve_device(train.device))


def apply_float8(model: nn.Module, plan: Float8Plan) -> list[str]:
    """Convert ``model``'s (or a pipeline stage's) eligible linears in place as ``plan.recipe``
    says; returns the names of the converted modules."""
    if plan.recipe == "none":
        return []
    from torchao.float8 import convert_to_float8_training

    convert = convert_filter(plan.recipe, plan.skip_small)
    converted = [fqn for fqn, module in model.named_modules() if convert(module, fqn)]
    config = linear_config(plan.recipe, plan.fsdp_all_gather, needs_emulation(plan.device))
    convert_to_float8_training(model, module_filter_fn=convert, config=config)
    return converted


def is_float8(module: nn.Module) -> bool:
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def float8_block_plan(block: nn.Module, plan: dict) -> dict:
    """``plan`` (a block's tensor-parallel plan) with torchao's float8 styles wherever the layer is
    float8 with tensorwise scaling: a float8 layer's input is cast before the all-gather (half the
    bytes of bf16), and its output gradient before the reduce-scatter. A module input is cast once
    for all its consumers (PrepareFloat8ModuleInput) only when every linear reading it is float8."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                       PrepareFloat8ModuleInput)

    def float8_tensorwise(fqn: str) -> bool:
        module = block.get_submodule(fqn)
        return is_float8(module) and module.config.cast_config_input.scaling_granularity.value == "tensorwise"

    out = dict(plan)
    for fqn, style in plan.items():
        if isinstance(style, (ColwiseParallel, RowwiseParallel)) and float8_tensorwise(fqn):
            kind = Float8ColwiseParallel if isinstance(style, ColwiseParallel) else Float8RowwiseParallel
            out[fqn] = kind(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                            use_local_output=style.use_local_output)
        elif isinstance(style, PrepareModuleInput):
            readers = [name for name in plan if name.startswith(f"{fqn}.")
                       and isinstance(plan[name], ColwiseParallel)]
            if readers and all(float8_tensorwise(name) for name in readers):
                out[fqn] = PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                                    desired_input_layouts=style.desired_input_layouts)
    return out


def precompute_float8_scales(parts: list[nn.Module]) -> None:
    """After the optimizer step, compute every float8-all-gathered weight's scale in one
    all-reduce (else each FSDP unit computes its own in forward, one all-reduce per weight)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in parts:
        precompute_float8_dynamic_scale_for_fsdp(part)


def check_float8(t, p) -> None:
    """train.float8* against the layout (called by validate.check, before any process group)."""
    if t.float8 not in RECIPES:
        raise ConfigError("train.float8", t.float8, "unknown float8 recipe", f"use one of {', '.join(RECIPES)}")
    if t.float8 == "none":
        if t.float8_fsdp_all_gather:
            raise ConfigError("train.float8_fsdp_all_gather", True, "train.float8=none converts no layer to "
                              "float8", "set train.float8=tensorwise, or train.float8_fsdp_all_gather=false")
        return
    if not torchao_available():
        raise ConfigError("train.float8", t.float8, "float8 training needs torchao, which is not installed",
                          "pip install 'parallel3d[float8]' (torchao), or set train.float8=none")
    if t.float8_fsdp_all_gather and t.float8 != "tensorwise":
        raise ConfigError("train.float8_fsdp_all_gather", True, f"torchao all-gathers float8 weights with one "
                          f"scale per tensor only, and train.float8={t.float8}",
                          "set train.float8=tensorwise, or train.float8_fsdp_all_gather=false")
    if t.float8_fsdp_all_gather and (p.zero_stage == 0 or p.dp_replicate * p.dp_shard == 1):
        raise ConfigError("train.float8_fsdp_all_gather", True, "no FSDP all-gather here (no data parallelism, "
                          "or parallel.zero_stage=0)", "set train.float8_fsdp_all_gather=false, or shard "
                          "with parallel.zero_stage 1-3 over several data-parallel ranks")
