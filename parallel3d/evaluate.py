"""Held-out evaluation: the mean token loss over fixed batches, forward only, in every layout.

The eval batches are the first ``eval.batches`` global batches of the held-out windows in the
sampler's seeded order (a pure function of the seed), split over data-parallel ranks exactly like
training batches, so every layout averages the same tokens. Under pipeline parallelism the
schedule's own forward-only path (``schedule.eval``) runs the micro batches through the stages;
the document ids and positions travel to every stage as the schedule's per-micro-batch keyword
inputs, as in training. torch 2.13's ``eval`` fails for ZBVZeroBubble (its action lists keep the
split backward actions: "can't steal_bwd_input if this stage doesn't have backward"), so for
it the micro batches go through the stages here, in stage order, with blocking point-to-point
sends of the hidden states between pp ranks.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from parallel3d.data import BatchSpec, StepSampler
from parallel3d.parallel.pipeline import stage_ids
from parallel3d.step import Setup, rank_batch


class Evaluator:
    """When to evaluate (every ``eval.every`` steps and at the last step) and how."""

    def __init__(self, tokens: np.ndarray, spec: BatchSpec, seed: int, eval_cfg, last_step: int):
        self.sampler = StepSampler(tokens, spec, seed)
        self.batches, self.every, self.last_step = eval_cfg.batches, eval_cfg.every, last_step

    def due(self, step: int) -> bool:
        return step == self.last_step or bool(self.every and step % self.every == 0)

    @torch.no_grad()
    def evaluate(self, setup: Setup) -> dict[str, float]:
        """``val_loss`` (mean token cross entropy over the eval batches) and ``val_perplexity``,
        the same on every rank. The loss is training's: a sum over a micro batch divided by the
        tokens of this rank's share of a global batch."""
        meshes = setup.meshes
        total = torch.zeros((), device=setup.device)
        for batch in range(1, self.batches + 1):
            total += _batch_loss(setup, self.sampler.micro_batches(batch))
        _reshard(setup.model)
        if meshes.pp is not None:  # only the last stage computed a loss
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=meshes.pp.get_group())
        if meshes.dp_cp is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=meshes.dp_cp.get_group())
        val_loss = total.item() / self.batches
        return {"val_loss": val_loss, "val_perplexity": math.exp(val_loss)}


def _batch_loss(s: Setup, micro_batches) -> torch.Tensor:
    """This rank's loss on its share of one global batch (forward only; the caller disables grad).
    Each micro batch is prepared as training prepares it (``setup.rank_batch``: device, document
    inputs, the context-parallel share)."""
    vocab_parallel = loss_parallel if s.meshes.tp is not None else contextlib.nullcontext
    loss_sum = torch.zeros((), device=s.device)
    pipeline, schedule = s.pipeline, s.config.parallel.pp_schedule
    if pipeline is None:
        for inputs, targets in micro_batches:
            inputs, targets, extra = rank_batch(s, inputs, targets)
            with vocab_parallel():
                loss_sum += _local(s.loss_fn(s.model(inputs, **extra), targets))
        return loss_sum
    if schedule in NO_TORCH_EVAL:
        owners = stage_owners(schedule, s.meshes.pp.size(), len(pipeline.stages))
        for inputs, targets in micro_batches:
            inputs, targets, extra = rank_batch(s, inputs, targets)
            with vocab_parallel():
                logits = _forward_through_stages(pipeline, owners, s.meshes.pp, inputs, extra)
                if logits is not None:  # this rank holds the last stage
                    loss_sum += _local(s.loss_fn(logits, targets))
        return loss_sum
    for k in range(0, len(micro_batches), pipeline.microbatches):  # as many per schedule call as training
        chunk = micro_batches[k : k + pipeline.microbatches]
        inputs, targets, extra = rank_batch(s, torch.cat([x for x, _ in chunk]), torch.cat([y for _, y in chunk]))
        losses: list[torch.Tensor] = []  # filled on the rank holding the last stage only
        with vocab_parallel():
            pipeline.schedule.eval(*([inputs] if pipeline.has_first_stage else []), target=targets, losses=losses,
                                   **extra)
        for loss in losses:
            loss_sum += _local(loss)
    return loss_sum


def _reshard(model: torch.nn.Module) -> None:
    """Put FSDP's sharded parameters back: a forward without backward leaves the root (and, with
    reshard_after_forward=False, every unit) holding its unsharded parameters, which are then the
    modules' registered parameters, not the optimizer's (a checkpoint saved next would miss them)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local(loss: torch.Tensor) -> torch.Tensor:
    return loss.full_tensor() if isinstance(loss, DTensor) else loss  # loss-parallel losses are DTensors


# Schedules whose forward-only path (``schedule.eval``) fails in torch 2.13 (see the docstring).
NO_TORCH_EVAL = ("ZBVZeroBubble",)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the hidden states sent between stages


def stage_owners(schedule: str, pp: int, per_rank: int) -> list[int]:
    """The pp rank that runs each stage, in stage order."""
    owners = {stage: rank for rank in range(pp) for stage in stage_ids(rank, pp, per_rank, schedule)}
    return [owners[stage] for stage in range(pp * per_rank)]


def _forward_through_stages(pipeline, owners: list[int], pp_mesh, inputs: torch.Tensor, extra: dict):
    """One micro batch through every stage in order: the last stage's output on the rank that runs
    it, None on the others. Every pp rank walks the same stage order, so the blocking sends and
    receives pair up; consecutive stages on one rank (the turn of a V) hand over locally."""
    me, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    modules = {stage.stage_index: stage.submod for stage in pipeline.stages}
    hidden = None
    for index, owner in enumerate(owners):
        previous = owners[index - 1] if index else None
        if owner == me:
            if index == 0:
                hidden = inputs
            elif previous != me:
                hidden = _receive(previous, group, inputs.device)
            hidden = modules[index](hidden, **extra)
        elif previous == me:
            _send(hidden, owner, group)
    return hidden if owners[-1] == me else None


def _send(hidden: torch.Tensor, peer: int, group) -> None:
    header = torch.tensor([*hidden.shape, _DTYPES.index(hidden.dtype)], dtype=torch.int64, device=hidden.device)
    dist.send(header, group_dst=peer, group=group)  # (batch, sequence shard, dim, dtype)
    dist.send(hidden.contiguous(), group_dst=peer, group=group)


def _receive(peer: int, group, device: torch.device) -> torch.Tensor:
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.recv(header, group_src=peer, group=group)
    *shape, dtype = header.tolist()
    hidden = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
    dist.recv(hidden, group_src=peer, group=group)
    return hidden
