"""parallelize(): the one function that states how the parallelisms compose on a model.

Order, applied to the model while it is still on the meta device:
    float8 -> tensor parallel -> LoRA -> context parallel -> expert parallel -> activation checkpointing
    -> torch.compile -> data parallel
Float8 goes first: it swaps module classes, which the tensor-parallel plans (float8 styles for
float8 layers), compile (the casts fuse into the blocks' kernels) and FSDP (float8 all-gather of
the weights) must all see.
Data parallelism goes last because FSDP must see the final (tensor-parallel, checkpointed,
compiled) blocks it shards: FSDP on top of tensor parallelism shards the tp-local DTensors
over the data-parallel mesh dims, giving 2D (or, with HSDP, 3D) parameters. In a lower
precision it runs in every layout, on a mesh of one rank if need be: its cast is the one
precision policy (``parallel/data.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from parallel3d.base import DTYPES
from parallel3d.config.schema import LoRAConfig
from parallel3d.models.lora import apply_lora
from parallel3d.parallel.activation import apply_activation_checkpointing, compile_blocks
from parallel3d.parallel.context import apply_context_parallel
from parallel3d.parallel.data import DataParallelPlan, ExpertSharding, apply_data_parallel
from parallel3d.parallel.expert import apply_expert_parallel
from parallel3d.parallel.float8 import Float8Plan, apply_float8
from parallel3d.parallel.mesh import Meshes


@dataclass(frozen=True)
class ActivationPlan:
    """What to recompute in backward (``model.activation_checkpoint`` and ``_every``)."""

    mode: str = "none"  # none | full | selective | op (parallel.activation.AC_MODES)
    every: int = 2  # selective: every Nth block


@dataclass(frozen=True)
class ParallelPlan:
    """Everything ``parallelize`` reads, typed: one object per consumer, built from the config."""

    data: DataParallelPlan
    sequence_parallel: bool = True
    cp_method: str = "alltoall"  # parallel.cp_method: how attention crosses the cp ranks
    float8: Float8Plan = Float8Plan()
    activation: ActivationPlan = ActivationPlan()
    compile: bool = False  # torch.compile each transformer block
    lora: Optional[LoRAConfig] = None  # model.lora when its rank is set: freeze the model, add adapters

    @classmethod
    def from_config(cls, c) -> "ParallelPlan":
        """From a validated config (the key names users know: model.activation_checkpoint ...)."""
        m = c.model
        return cls(data=data_parallel_plan(c.parallel, c.train), sequence_parallel=c.parallel.sequence_parallel,
                   cp_method=c.parallel.cp_method, float8=Float8Plan.from_config(c.train),
                   activation=ActivationPlan(m.activation_checkpoint, m.activation_checkpoint_every), compile=m.compile,
                   lora=m.lora if m.lora.rank else None)


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


def parallelize(model: nn.Module, meshes: Meshes, plan: ParallelPlan) -> None:
    """Apply every parallelism of ``plan`` to ``model`` (the whole model, or one pipeline stage)
    in place, in the order above."""
    float8_layers = apply_float8(model, plan.float8)
    if meshes.tp is not None:
        from parallel3d.parallel.tensor import apply_tensor_parallel  # DTensor's plans: only under tp

        # Float8 TP styles send float8 activations, a dtype gloo cannot carry ("Invalid scalar
        # type"): on the CPU the float8 layers compute in float8 between bf16/fp32 collectives.
        float8_tp = bool(float8_layers) and plan.float8.device == "cuda"
        apply_tensor_parallel(model, meshes.tp, plan.sequence_parallel, float8=float8_tp)
    if plan.lora is not None:  # after tp: the adapters take the split of the layer they adapt
        apply_lora(model, plan.lora)
    if meshes.cp is not None:
        apply_context_parallel(model, meshes.cp, plan.cp_method)
    tp = meshes.tp.size() if meshes.tp is not None else 1
    experts = None
    if meshes.ep is not None:
        experts = ExpertSharding(apply_expert_parallel(model, meshes.ep, tp), meshes.expert_dp)
    apply_activation_checkpointing(model, plan.activation.mode, plan.activation.every)
    if plan.compile:
        compile_blocks(model)
    # cp ranks hold the same parameters as data-parallel ranks do. Without either, the wrapper
    # still runs, on this rank alone, where its mixed-precision policy has something to cast.
    if meshes.data_parallel is not None:
        apply_data_parallel(model, meshes.data_parallel, meshes.fsdp or meshes.precision, plan.data, experts)
