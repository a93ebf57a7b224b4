"""parallelize(): the one function that states how the parallelisms compose on a model.

Order, applied to the model while it is still on the meta device:
    tensor parallel -> activation checkpointing -> torch.compile -> data parallel
Data parallelism goes last because FSDP must see the final (tensor-parallel, checkpointed,
compiled) blocks it shards: FSDP on top of tensor parallelism shards the tp-local DTensors
over the data-parallel mesh dims, giving 2D (or, with HSDP, 3D) parameters.
"""

from __future__ import annotations

from torch import nn

from parallel3d.mesh import Meshes
from parallel3d.parallel.activation import apply_activation_checkpointing, compile_blocks
from parallel3d.parallel.data import DataParallelPlan, apply_data_parallel
from parallel3d.parallel.expert import apply_expert_parallel
from parallel3d.parallel.tensor import apply_tensor_parallel
from parallel3d.validate import DTYPES


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
    if meshes.tp is not None:
        apply_tensor_parallel(model, meshes.tp, parallel.sequence_parallel)
    experts = apply_expert_parallel(model, meshes.ep) if meshes.ep is not None else set()
    apply_activation_checkpointing(model, model.cfg.activation_checkpoint, model.cfg.activation_checkpoint_every)
    if model.cfg.compile:
        compile_blocks(model)
    if meshes.dp is not None:
        apply_data_parallel(model, meshes.dp, meshes.fsdp, data_parallel_plan(parallel, train), ignored=experts)
