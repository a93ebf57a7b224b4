"""Data parallelism: ZeRO stages mapped onto torch's composable DDP (``replicate``) and FSDP2.

    zero_stage  params                  grads                       optimizer state  torch API
    0 (DDP)     replicated              all-reduced once per step   replicated       replicate
    1           gathered once per step  reduce-scattered per step   sharded          fully_shard, no reshard*
    2           gathered per micro b.   reduce-scattered per m. b.  sharded          fully_shard(reshard_after_forward=False)
    3 (FSDP)    gathered per block use  reduce-scattered per m. b.  sharded          fully_shard(reshard_after_forward=True)

    * ``set_gradient_sync``: over a step's micro batches, parameters stay gathered and gradients
      accumulate unsharded; the last backward reduce-scatters them and reshards.

Every stage keeps its float32 master weights and optimizer state sharded at rest except DDP.
ZeRO-1 holds the whole (tp-local) model in the compute dtype and its whole gradient while it steps,
as DeepSpeed's stage 1 does, and moves the minimum for a sharded optimizer: one all-gather and one
reduce-scatter of the parameters per step, overlapped with forward and backward by FSDP. (Built on
``replicate``, it would all-reduce whole gradients, 2(n-1)/n, of which each rank steps 1/n, then
gather the updated rows: 3(n-1)/n where 2(n-1)/n do.) ZeRO-2 frees the gathered parameters and
reduces the gradients every micro batch; ZeRO-3 frees each block's parameters after its forward.

When parameters are gathered (ZeRO-3): each block in forward and again in backward; the root
(embedding, final norm, output) once per micro batch, since FSDP keeps the root gathered for the
backward that starts right after its forward (``reshard_after_forward=None``). Under pipeline
parallelism every sharded stage behaves as ZeRO-1 does over one schedule step: torch's schedule
keeps a stage's parameters gathered from its first backward to the end of the schedule step and
reduces the gradients once, so ZeRO-3 does not reshard after each forward there either (that only
gathered them again, once per micro batch: 34 gathers per step instead of 1 on the 405B recipe,
for no saving at the peak, which 1F1B-type schedules reach when their first backward starts).

Stage 0 replicates over all data-parallel ranks and stage 1 shards over all of them (dp_replicate
x dp_shard x cp, flattened: ``Meshes.dp_cp``; cp ranks hold the same parameters). Stages 2 and 3
shard over dp_shard x cp and, when dp_replicate > 1, replicate the shards across dp_replicate
groups (HSDP: HYBRID_SHARD_ZERO2 / HYBRID_SHARD) through FSDP2's 2D mesh.

Precision, one policy for every layout: float32 master weights and optimizer state; in forward
and backward the whole model computes in ``train.param_dtype`` (FSDP's MixedPrecisionPolicy casts
each unit's parameters as it gathers them, and the root's floating inputs), the residual stream
and the hidden states between pipeline stages included; gradients come back in the compute
dtype, are cast to ``train.reduce_dtype``, reduced (and accumulated over micro batches) in it,
and reach the float32 masters. Without data parallelism the same wrapper runs on a mesh of one
rank (``mesh.Meshes.precision``): FSDP skips the collectives there but casts exactly as it does
on n ranks, so one process, tp, pp and cp layouts compute what data-parallel ones compute.
(torchtitan, like this code before, casts with FSDP under FSDP and with torch.autocast without
it, which keeps a float32 residual stream and normalizations: two policies, 5e-4 apart in loss
after 10 bf16 steps of the tiny model. Autocast everywhere instead would have FSDP gather and
hold float32 parameters, twice the all-gather bytes and unsharded memory.) See
docs/parallelism.md, Precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:  # imported where a model is wrapped (FSDP's import is not free)
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy


@dataclass(frozen=True)
class DataParallelPlan:
    zero_stage: int
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    wrap: str = "block"  # block | size
    min_params: int = 100_000_000
    prefetch: int = 0
    cpu_offload: bool = False
    pipelined: bool = False  # the model is a pipeline stage (see the docstring)

    @property
    def reshard_blocks_after_forward(self) -> bool:
        return self.zero_stage == 3 and not self.pipelined


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh, fsdp_mesh: DeviceMesh | None,
                        plan: DataParallelPlan, experts: ExpertSharding | None = None) -> None:
    """Wrap ``model`` (still on the meta device) in place for data-parallel training. ``experts``:
    the expert-parallel experts, which get units of their own on their own mesh (see below)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype)
    ignored = experts.ignored if experts is not None else None
    if plan.zero_stage == 0:
        if experts is not None:
            experts.wrap(plan, mp_policy)
        replicate(model, mesh=dp_mesh, mp_policy=mp_policy, ignored_params=ignored)
        return
    shard = dict(mesh=dp_mesh if plan.zero_stage == 1 else fsdp_mesh, mp_policy=mp_policy, ignored_params=ignored,
                 offload_policy=CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy())
    # Units inside the root receive activations already in the compute dtype, and the RoPE tables,
    # which must stay float32: cast, they would lose precision and every block would keep its own
    # copy per micro batch as a checkpointed input (5 GiB at the 405B recipe's peak).
    units = dict(shard, reshard_after_forward=plan.reshard_blocks_after_forward,
                 mp_policy=MixedPrecisionPolicy(param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                                                cast_forward_inputs=False))
    if experts is not None:  # first: the blocks' units then leave the experts' parameters to them
        experts.wrap(plan, units["mp_policy"], units["offload_policy"])
    blocks = list(model.layers.values())
    if plan.wrap == "block":
        for block in blocks:
            fully_shard(block, **units)
    else:
        _shard_by_size(model, plan.min_params, units)
    fully_shard(model, **shard, reshard_after_forward=None if plan.reshard_blocks_after_forward else False)
    if shard["mesh"].device_type == "cpu" and shard["mesh"].size() > 1:
        _overlap_gathers_on_host(model, blocks if plan.wrap == "block" else [], plan.prefetch)
    elif plan.prefetch:
        _set_prefetch(blocks, plan.prefetch)


@dataclass
class ExpertSharding:
    """Expert-parallel experts (``parallel/expert.py``: DTensors split over the ep mesh) and
    ``expert_dp``, the ranks that hold the same experts (None: no other rank does).

    Over expert_dp the experts follow the ZeRO stage as every other weight does, in a unit of
    their own per MoE block: replicated (ZeRO-0) or sharded (1-3), so each rank keeps 1/expert_dp
    of their master weights, gradients and optimizer state. FSDP shards dim 0, the experts, so a
    rank's shard is whole experts, as checkpoints in Hugging Face's layout (one tensor per expert)
    read and write them (``hf.hf_tensors``); with fewer experts than ranks some hold none (FSDP
    pads). Without expert_dp the wrapper leaves the experts alone (nothing to shard or reduce) and
    ``GroupedExperts`` casts them to the compute dtype itself: the same bf16 product, and
    gradients reach the float32 masters as through FSDP's cast.
    """

    modules: list[nn.Module]
    expert_dp: DeviceMesh | None

    @property
    def ignored(self) -> set[nn.Parameter] | None:
        if self.expert_dp is not None:
            return None
        return {p for module in self.modules for p in module.parameters()} or None

    def wrap(self, plan: DataParallelPlan, mp_policy: MixedPrecisionPolicy,
             offload_policy: OffloadPolicy | None = None) -> None:
        if self.expert_dp is None:
            return
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import OffloadPolicy, fully_shard

        offload_policy = offload_policy or OffloadPolicy()
        for module in self.modules:
            if plan.zero_stage == 0:
                replicate(module, mesh=self.expert_dp, mp_policy=mp_policy)
                continue
            fully_shard(module, mesh=self.expert_dp, mp_policy=mp_policy, offload_policy=offload_policy,
                        reshard_after_forward=plan.reshard_blocks_after_forward)


def _shard_by_size(root: nn.Module, min_params: int, shard: dict) -> None:
    """Give a submodule its own FSDP unit once it holds ``min_params`` not yet claimed below it."""
    from torch.distributed.fsdp import fully_shard

    def visit(module: nn.Module) -> int:
        unclaimed = sum(visit(child) for child in module.children())
        unclaimed += sum(p.numel() for p in module.parameters(recurse=False))
        is_container = isinstance(module, (nn.ModuleDict, nn.ModuleList))  # no forward of its own to hook
        if module is not root and not is_container and unclaimed >= min_params:
            fully_shard(module, **shard)
            return 0
        return unclaimed

    visit(root)


def _overlap_gathers_on_host(model: nn.Module, blocks: list[nn.Module], prefetch: int) -> None:
    """On a CPU device, FSDP's all-gathers overlap compute as its streams make them do on a GPU.

    Without streams FSDP calls gloo synchronously: a prefetch, its own in backward included, then
    blocks the rank's one compute thread until the peers arrive, and every gather waits in full.
    Issued asynchronously, gloo's threads move the next block's parameters while this one computes.
    In forward the root starts the first block's gather and each block the next one's
    (``parallel.fsdp_prefetch=0``; N: the next N), what FSDP's streams do on CUDA. The gathers and
    their bytes are the same, and so are the units held at once: the one in compute and the one
    prefetched, which the planner counts. ``blocks``: empty when they are not units (``fsdp_wrap=size``)."""
    model._set_unshard_async_op(True)  # torch's own switch; the prefetch lists below make it overlap
    model.set_modules_to_forward_prefetch(blocks[:1])
    _set_prefetch(blocks, max(prefetch, 1))


def _set_prefetch(blocks: list[nn.Module], n: int) -> None:
    """Start the all-gather of the next n blocks while this one computes (forward and backward)."""
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + n])
        block.set_modules_to_backward_prefetch(blocks[max(i - n, 0) : i][::-1])


def set_gradient_sync(model: nn.Module, sync: bool, zero_stage: int) -> None:
    """Reduce gradients only on the last micro batch of a step (``sync``) for DDP and ZeRO-1, which
    keep ZeRO-1's parameters gathered in between. (Under pipeline parallelism torch's schedule does
    this itself, for every stage.)

    ZeRO-2 and 3 reduce-scatter every micro batch instead: accumulating unsharded gradients would
    cost the memory those stages exist to save.
    """
    if zero_stage <= 1:
        model.set_requires_gradient_sync(sync)
    if zero_stage == 1:
        model.set_reshard_after_backward(sync)

