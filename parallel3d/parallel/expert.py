"""Expert parallelism: the experts of each MoE block split over ``parallel.ep`` ranks.

The ep ranks are borrowed from the ranks that hold different tokens of one pipeline stage:
dp_shard x cp x tp (torchtitan's choice, with experts not tensor-parallel: ETP=1). Their
flattened view, tp innermost, is unflattened into (expert_dp, ep): ep neighbours are consecutive
ranks, so ep takes tp ranks first, then cp, then dp_shard ones. Each ep rank routes its own
tokens (under cp and sequence-parallel tp, those of its piece of each sequence); an all-to-all
sends every token copy to the rank that holds its expert, that rank runs its experts on what it
received, and a second all-to-all brings the results back, in the order they left. Backward is the
same exchange in reverse (``AllToAll``).

Gradients: an expert sees the tokens of all ep ranks, so its gradient sums their parts of the
loss. Data parallelism averages gradients over the dp x cp ranks (each a whole loss of its own),
while tp ranks' tokens are parts of one such loss, to be summed. Over the ``expert_dp`` ranks
(the rest of dp x cp x tp, which hold the same experts) the data-parallel wrapper averages them,
in units of their own (``parallel.data.ExpertSharding``: replicated under ZeRO-0, sharded over
expert_dp under ZeRO-1 to 3): with ``grad_scale = tp / ep`` the result is the dp x cp average of
every rank's sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel3d.base import ConfigError, divisors, is_dtensor
from parallel3d.config.schema import ModelConfig
from parallel3d.models.moe import GroupedExperts, MoE, is_moe_layer, split_sizes


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


class AllToAllDispatch:
    """Send expert-sorted tokens to their experts' ranks, compute, and bring the results back."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group, self.ep = ep_mesh.get_group(), ep_mesh.size()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        per_rank = counts.view(self.ep, -1)  # (destination rank, its local expert)
        received = torch.empty_like(per_rank)  # (source rank, my local expert)
        dist.all_to_all_single(received, per_rank, group=self.group)
        send = split_sizes(per_rank.sum(1), x.shape[0])
        recv = split_sizes(received.sum(1), x.shape[0])  # (balanced in the dry run: what was sent)
        tokens = AllToAll.apply(x, recv, send, self.group)
        # Arrived grouped by source rank, then expert: regroup by expert (stable: source order kept).
        local_experts = torch.arange(per_rank.shape[1], device=x.device).repeat(self.ep)
        order = torch.repeat_interleave(local_experts, received.flatten(), output_size=tokens.shape[0])
        order = order.argsort(stable=True)
        out = experts(tokens[order], received.sum(0))
        out = torch.empty_like(out).index_copy(0, order, out)  # back to arrival order
        return AllToAll.apply(out, send, recv, self.group)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, tp: int = 1) -> list[GroupedExperts]:
    """Split the experts of ``model``'s MoE blocks (still on meta) over ``ep_mesh`` along the
    expert dim; returns the split modules (data parallelism gives them units of their own).
    ``tp``: the tensor-parallel degree (its ranks' tokens are parts of one loss: module docstring)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    split: list[GroupedExperts] = []
    for block in model.layers.values():
        if not isinstance(block.feed_forward, MoE):
            continue
        moe = block.feed_forward
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            whole = param.to_local().detach() if is_dtensor(param) else param  # tp replicated: whole
            sharded = nn.Parameter(distribute_tensor(whole, ep_mesh, [Shard(0)], src_data_rank=None))
            experts.register_parameter(name, sharded)
        experts.grad_scale = tp / ep_mesh.size()
        moe.dispatch = AllToAllDispatch(ep_mesh)
        split.append(experts)
    return split


def configure_moe(parts: list[nn.Module], sequences: int, sequence_mesh: DeviceMesh | None, cp: int) -> None:
    """What each MoE block's aux loss needs: the ``sequences`` a data-parallel rank trains on per
    step (the loss is their mean), the ranks that split each sequence (``sequence_mesh``: cp x tp,
    flattened), and ``cp``: data parallelism averages gradients over cp ranks as if each held
    sequences of its own, so each one's part of the loss counts cp times in its gradient."""
    for part in parts:
        for module in part.modules():
            if isinstance(module, MoE):
                module.sequences_per_step = sequences
                module.sequence_group = sequence_mesh.get_group() if sequence_mesh is not None else None
                module.sequence_split = sequence_mesh.size() if sequence_mesh is not None else 1
                module.aux_grad_scale = float(cp)


@dataclass(frozen=True)
class ExpertLoads:
    """One step's expert statistics over every rank: ``loads`` (MoE blocks x experts, token copies
    the experts computed), ``aux`` (the balancing loss as added to each data-parallel rank's loss,
    summed), ``dropped`` (copies dropped for capacity). Tensors: the dry run makes them fake."""

    loads: torch.Tensor
    aux: torch.Tensor
    dropped: torch.Tensor


def reduce_expert_loads(parts: list[nn.Module], cfg: ModelConfig, *, micro_batches: int, world_group_size: int,
                        device: torch.device) -> ExpertLoads | None:
    """This step's expert statistics summed over the world in one all-reduce (pipeline stages hold
    different blocks, data ranks different tokens), and the blocks' counters reset. The metrics
    (:func:`expert_metrics`) and the sigmoid routers' bias step (:func:`update_router_bias`) both
    read the result. ``micro_batches``: the forwards each block ran this step. None for a dense
    model; otherwise every rank must call it."""
    names = [str(i) for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]
    if not names:
        return None
    local = _local_blocks(parts, names)
    stats = torch.zeros(2 + len(names) * cfg.moe.num_experts, dtype=torch.float64)  # aux, dropped, loads
    for i, name in enumerate(names):
        if name in local:
            tokens, aux = local[name].step_stats(micro_batches)
            stats[0] += aux
            stats[1] += local[name].step_dropped(micro_batches)
            stats[2 + i * cfg.moe.num_experts : 2 + (i + 1) * cfg.moe.num_experts] = tokens
            local[name].reset_stats()
    stats = _sum_over_world(stats, world_group_size, device)
    return ExpertLoads(loads=stats[2:].view(len(names), cfg.moe.num_experts), aux=stats[0], dropped=stats[1])


def expert_metrics(expert_loads: ExpertLoads | None, *, dp: int) -> dict:
    """The step's ``aux_loss`` (as added to the loss: mean over the global batch, summed over MoE
    blocks), tokens per expert summed over blocks (``expert_load``), the worst block's
    ``expert_load_max_over_mean`` and the copies dropped for capacity (``expert_dropped``); {} for
    a dense model."""
    if expert_loads is None:
        return {}
    loads = expert_loads.loads
    imbalance = (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-12)).max()
    return {"aux_loss": float(expert_loads.aux / dp), "expert_load": [int(v) for v in loads.sum(0).tolist()],
            "expert_load_max_over_mean": float(imbalance), "expert_dropped": int(expert_loads.dropped)}


@torch.no_grad()
def update_router_bias(parts: list[nn.Module], cfg: ModelConfig, expert_loads: ExpertLoads | None) -> None:
    """DeepSeek-V3's aux-loss-free balancing, a step of its own after the optimizer's: each sigmoid
    router's bias moves by ``bias_update_rate`` towards even load, up for the experts that computed
    fewer token copies than the block's mean this step (over all ranks), down for busier ones.
    Nothing to do for softmax routers and dense models."""
    if cfg.moe.router != "sigmoid" or expert_loads is None:
        return
    names = [str(i) for i in range(cfg.n_layers) if is_moe_layer(cfg, i)]
    local = _local_blocks(parts, names)
    for i, name in enumerate(names):
        if name in local:
            bias = local[name].router.expert_bias
            bias += cfg.moe.bias_update_rate * torch.sign(expert_loads.loads[i].mean() - expert_loads.loads[i]).to(bias)


def _local_blocks(parts: list[nn.Module], names: list[str]) -> dict[str, MoE]:
    """This rank's MoE feed-forwards among the blocks ``names`` (a pipeline stage holds some)."""
    return {name: part.layers[name].feed_forward for part in parts for name in names if name in part.layers}


def _sum_over_world(values: torch.Tensor, world_group_size: int, device: torch.device) -> torch.Tensor:
    if world_group_size == 1:
        return values
    values = values.to(device)  # NCCL reduces device tensors only
    dist.all_reduce(values)
    return values.cpu()


def _check_groups(moe, n_layers: int) -> None:
    """DeepSeek-V3's group-limited routing and first dense blocks."""
    if not moe.num_experts:
        return
    if not 0 <= moe.first_dense_layers < n_layers:
        raise ConfigError("model.moe.first_dense_layers", moe.first_dense_layers, f"must be in 0..n_layers-1="
                          f"{n_layers - 1}", "keep at least one MoE block, or set model.moe.num_experts=0")
    if moe.n_group == 1:
        return
    if moe.router != "sigmoid":
        raise ConfigError("model.moe.n_group", moe.n_group, "group-limited routing is the sigmoid router's "
                          f"(DeepSeek-V3's), not model.moe.router={moe.router}'s",
                          "set model.moe.router=sigmoid, or model.moe.n_group=1")
    per_group = moe.num_experts // max(moe.n_group, 1)
    if moe.n_group < 1 or moe.num_experts % moe.n_group or per_group < 2:
        # Only group counts the next run accepts: with this topk_group and top_k too (1: no groups).
        fits = [d for d in divisors(moe.num_experts) if d == 1 or (
            moe.num_experts // d >= 2 and moe.topk_group <= d and moe.top_k <= moe.topk_group * (moe.num_experts // d))]
        raise ConfigError("model.moe.n_group", moe.n_group, "group-limited routing needs groups of >= 2 experts "
                          f"dividing num_experts={moe.num_experts}",
                          f"set model.moe.n_group to one of {', '.join(map(str, fits))}")
    if not 1 <= moe.topk_group <= moe.n_group or moe.top_k > moe.topk_group * per_group:
        raise ConfigError("model.moe.topk_group", moe.topk_group, f"must be in 1..n_group={moe.n_group} and hold "
                          f"top_k={moe.top_k} experts", f"set model.moe.topk_group to one of "
                          f"{', '.join(map(str, range(-(-moe.top_k // per_group), moe.n_group + 1)))}")


def check_experts(m, p) -> None:
    """model.moe.* and parallel.ep (parallel3d/models/moe.py, parallel3d/parallel/expert.py)."""
    moe = m.moe
    if moe.num_experts < 0 or moe.every < 1 or moe.shared_experts < 0 or moe.expert_ffn_dim < 0:
        raise ConfigError("model.moe", dict(moe), "num_experts, shared_experts, expert_ffn_dim must be >= 0 "
                          "and every >= 1", "fix the negative or zero value")
    if moe.num_experts and not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError("model.moe.top_k", moe.top_k, f"must be in 1..num_experts={moe.num_experts}",
                          "choose top_k <= model.moe.num_experts")
    if moe.capacity_factor < 0:
        raise ConfigError("model.moe.capacity_factor", moe.capacity_factor, "must be >= 0",
                          "use 0 for dropless routing or a factor such as 1.25")
    if moe.router not in ("softmax", "sigmoid"):
        raise ConfigError("model.moe.router", moe.router, "unknown router", "use softmax or sigmoid")
    _check_groups(moe, m.n_layers)
    if moe.num_experts and p.tp > 1 and not p.sequence_parallel:  # each tp rank routes its sequence shard
        raise ConfigError("parallel.sequence_parallel", False, "mixture-of-experts blocks under tensor parallelism "
                          "route each tp rank's sequence shard", "set parallel.sequence_parallel=true with parallel.tp > 1")
    if p.ep == 1:
        return
    if not moe.num_experts or moe.num_experts % p.ep:
        raise ConfigError("parallel.ep", p.ep, f"splits model.moe.num_experts={moe.num_experts} over ep ranks "
                          "and must divide it", f"choose parallel.ep from {divisors(moe.num_experts or 1)}")
    pool = p.dp_shard * p.cp * p.tp
    if p.ep < 1 or pool % p.ep:
        raise ConfigError("parallel.ep", p.ep, f"borrows its ranks from parallel.dp_shard x cp x tp={pool} and must "
                          "divide it", f"choose parallel.ep from {divisors(pool)}")
    if m.compile:
        raise ConfigError("model.compile", True, "expert parallelism's all-to-all takes its split sizes from "
                          "the routing (a graph break per block)", "set model.compile=false with parallel.ep > 1")
