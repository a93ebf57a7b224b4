"""ZeRO-1: optimizer state sharded over data-parallel ranks, parameters and gradients replicated.

torch's ZeroRedundancyOptimizer cannot take the DTensor parameters of composable ``replicate``,
and it partitions whole parameters, so its memory drifts from the ideal. This builds the same
thing on DTensor instead: each replicated parameter gets a ``Shard(0)`` DTensor that is a *view*
of this rank's rows of it, and the optimizer steps those views, so its state is exactly the
rank's 1/N along dim 0 (the layout FSDP2 uses, so checkpoints move freely between stages).

One step: gradients are all-reduced by ``replicate`` as for DDP; the optimizer updates this
rank's rows in place; ``full_tensor()`` all-gathers the updated rows into every replica.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def _rows(local: torch.Tensor, mesh: DeviceMesh) -> slice:
    """This rank's dim-0 rows under torch.chunk semantics (what Shard(0) means)."""
    rows = local.shape[0]
    per_rank = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, rows)
    return slice(start, min(start + per_rank, rows))


def shard_rows(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return local[_rows(local, mesh)]


def _shard_view(tensor: DTensor, mesh: DeviceMesh) -> DTensor:
    """Rows of this rank's local tensor (the tp shard, under tensor parallelism) over the dp mesh."""
    local = tensor.to_local()
    return DTensor.from_local(shard_rows(local, mesh), mesh, [Shard(0)], shape=local.shape,
                              stride=local.stride(), run_check=False)


def shard_optimizer_state(model: nn.Module, mesh: DeviceMesh, make_optimizer) -> torch.optim.Optimizer:
    """An optimizer built by ``make_optimizer(params)`` over row shards of ``model``'s parameters.

    Hooks keep it in step with the model: before ``step()`` each shard takes its rows of the
    (already reduced, possibly clipped) gradient; after it, the new rows are gathered back.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    shards = [nn.Parameter(_shard_view(p.data, mesh)) for p in params]
    optimizer = make_optimizer(shards)

    def take_gradients(opt, args, kwargs):
        for param, shard in zip(params, shards):
            shard.grad = None if param.grad is None else _shard_view(param.grad, mesh)

    @torch.no_grad()
    def gather_parameters(opt, args, kwargs):
        for param, shard in zip(params, shards):
            param.to_local().copy_(shard.full_tensor())  # all-gather over dp only
            shard.grad = None

    optimizer.register_step_pre_hook(take_gradients)
    optimizer.register_step_post_hook(gather_parameters)
    return optimizer
