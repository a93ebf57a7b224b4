"""parallelize(): the one function that states how the parallelisms compose on a model.

Order, applied to the model while it is still on the meta device:
    float8 -> tensor parallel -> activation checkpointing -> torch.compile -> data parallel
Float8 goes first: it swaps module classes, which the tensor-parallel plans (float8 styles for
float8 layers), compile (the casts fuse into the blocks' kernels) and FSDP (float8 all-gather of
the weights) must all see.
Data parallelism goes last because FSDP must see the final (tensor-parallel, checkpointed,
compiled) blocks it shards: FSDP on top of tensor parallelism shards the tp-local DTensors
over the data-parallel mesh dims, giving 2D (or, with HSDP, 3D) parameters.
"""

from __future__ import annotations

from torch import nn

from parallel3d.mesh import Meshes
from parallel3d.parallel.activation import apply_activation_checkpointing, compile_blocks
from parallel3d.parallel.data import DataParallelPlan, apply_data_parallel
from parallel3d.parallel.float8 import apply_float8
from parallel3d.parallel.tensor import apply_tensor_parallel
from parallel3d.validate import DTYPES, resolve_device


def data_parallel_plan(parallel, train) -> DataParallelPlan:
    return DataParallelPlan(
        zero_stage=parallel.zero_stage,
        param_dtype=DTYPES[train.param_dtype],
        reduce_dtype=DTYPES[train.reduce_dtype],
        wrap=parallel.fsdp_wrap,
        min_params=parallel.fsdp_min_params,
        prefetch=parallel.fsdp_prefetch,
        cpu_offload=parallel.cpu_offload,
        pipelined=parallel.pp > 1,
    )


def parallelize(model: nn.Module, meshes: Meshes, parallel, train) -> None:
    """Apply every configured parallelism to ``model`` (the whole model, or one pipeline stage) in
    place, in the order above. Activation checkpointing and compile read the model's own config."""
    device = resolve_device(train.device)
    float8_layers = apply_float8(model, train, device)
    if meshes.tp is not None:
        # Float8 TP styles send float8 activations, a dtype gloo cannot carry ("Invalid scalar
        # type"): on the CPU the float8 layers compute in float8 between bf16/fp32 collectives.
        float8_tp = bool(float8_layers) and device == "cuda"
        apply_tensor_parallel(model, meshes.tp, parallel.sequence_parallel, float8=float8_tp)
    apply_activation_checkpointing(model, model.cfg.activation_checkpoint, model.cfg.activation_checkpoint_every)
    if model.cfg.compile:
        compile_blocks(model)
    if meshes.dp is not None:
        apply_data_parallel(model, meshes.dp, meshes.fsdp, data_parallel_plan(parallel, train))
