"""Pipeline parallelism: split the model into stages and run them with torch's schedules.

A stage is the full model built on the meta device with the blocks (and embedding, norm, output)
it does not own deleted. Blocks live in an ``nn.ModuleDict`` keyed by their index, so a stage's
parameters keep the names they have in the full model and checkpoints do not depend on the split.

Stages per rank: single-stage schedules (GPipe, 1F1B) give each pp rank one stage. Looped
schedules (Interleaved1F1B, InterleavedZeroBubble) give rank r the stages r, r+pp, r+2pp, ...
V schedules (ZBVZeroBubble, DualPipeV) give rank r exactly two: r and 2pp-1-r, so the first
and last stages share rank 0.

Tied embeddings: the last stage keeps ``tok_embeddings`` (same name, so same initial values and
checkpoint key) as its output projection, and ``TiedEmbeddings`` sums the two copies' gradients
after backward, so both take the same optimizer steps and stay equal.

The layer split counts the embedding and the output projection as one layer each, so the first
and last stages carry one block fewer when the split is even; ``parallel.pp_layers_per_stage``
sets the blocks per stage explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel3d.base import is_dtensor, local_tensor
from parallel3d.config.schema import ModelConfig
from parallel3d.models import Transformer

# parallel.pp_schedule: torch's schedule class of each name (torch.distributed.pipelining.schedules),
# imported when a pipeline is built: validation and the planner read only the names and the rules
# below, and torch's pipelining import (it loads torch._dynamo) costs seconds on every rank.
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("GPipe", "1F1B")  # subclasses of torch's PipelineScheduleSingle (tests/test_parallel_pipeline.py)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def schedule_class(schedule: str) -> type:
    """torch's class for the schedule named ``schedule``."""
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULES[schedule])


def is_single_stage(schedule: str) -> bool:
    return schedule in SINGLE_STAGE


def fixed_stages_per_rank(schedule: str) -> int | None:
    """The stages each pp rank runs where the schedule fixes it (1, or 2 for a V); None: looped, any."""
    if is_single_stage(schedule):
        return 1
    return 2 if schedule in V_SCHEDULES else None


def stages_per_rank(schedule: str, configured: int | None) -> int:
    return fixed_stages_per_rank(schedule) or configured or 2


def min_microbatches(schedule: str, pp: int, num_stages: int) -> int:
    """The fewest microbatches per schedule step ``schedule`` runs: GPipe any number, DualPipeV one
    per stage (torch refuses fewer), the others one per pp rank (fewer leave a rank idle throughout)."""
    return {"GPipe": 1, "DualPipeV": num_stages}.get(schedule, pp)


def fits_rounds(schedule: str, pp: int, microbatches: int) -> bool:
    """Multi-stage schedules run microbatches in rounds of about ``pp``: torch's looped schedules
    refuse a count that is not a multiple of their number of rounds, max(1, microbatches // pp)."""
    return is_single_stage(schedule) or microbatches % max(1, microbatches // pp) == 0


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def layer_split(n_layers: int, num_stages: int, explicit: list[int] | None = None) -> list[range]:
    """The blocks each stage holds, in order."""
    if explicit:
        counts = list(explicit)
    else:
        base, extra = divmod(n_layers + 2, num_stages)  # + embedding + output
        counts = [base + (i < extra) for i in range(num_stages)]
        counts[0] -= 1
        counts[-1] -= 1
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def stage_model(cfg: ModelConfig, stage: int, num_stages: int, layers: range) -> Transformer:
    """The part of the model that ``stage`` runs, on the meta device, with full-model names."""
    with torch.device("meta"):
        model = Transformer(cfg)
    for name in list(model.layers):
        if int(name) not in layers:
            del model.layers[name]
    if stage != 0:
        model.embeds_input = False
        if not (cfg.tie_embeddings and stage == num_stages - 1):
            model.tok_embeddings = None  # (a tied last stage keeps it: it is the output projection)
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    return model


# (inputs, targets[, doc_ids]) of a micro batch -> (inputs, targets, keyword inputs) as this rank runs them
Prepare = Callable[..., tuple[torch.Tensor, torch.Tensor, dict]]


@dataclass
class Pipeline:
    parts: list[nn.Module]  # this rank's stage modules, in stage order
    stages: list  # torch's PipelineStage, one per part
    schedule: object
    microbatches: int  # per schedule step
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    @property
    def has_first_stage(self) -> bool:
        return any(stage.is_first for stage in self.stages)

    def forward_backward(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], prepare: Prepare
                         ) -> list[torch.Tensor]:
        """Forward and backward of one optimizer step's micro batches through all stages, in
        schedule steps of ``self.microbatches`` each (fewer than all: gradient accumulation).
        Returns the detached micro-batch losses this rank computed (the last stage's rank only).
        ``prepare(inputs, targets)`` -> (inputs, targets, keyword inputs) as this rank runs them (on
        its device, its context-parallel share); the schedule splits the keyword inputs (document
        ids, positions) into micro batches and hands them to every stage beside its activations."""
        losses: list[torch.Tensor] = []
        for inputs, targets, extra in self._schedule_steps(micro_batches, prepare):
            chunk_losses: list[torch.Tensor] = []  # step() clears and refills it
            # return_outputs=False: else the last stage keeps every microbatch's logits for step() to
            # return (4 GiB on the 405B recipe), which nothing here reads.
            self.schedule.step(*([inputs] if self.has_first_stage else []), target=targets, losses=chunk_losses,
                               return_outputs=False, **extra)
            losses += [loss.detach() for loss in chunk_losses]
        return losses

    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], prepare: Prepare
                     ) -> list[torch.Tensor]:
        """The micro batches' losses, forward only (the caller disables grad), as ``forward_backward``
        returns them: through the schedule's own forward-only path (``eval``). torch 2.13's ``eval``
        replays the schedule's actions with backward switched off, and ZBVZeroBubble's split
        backward at the turn of its V still asks for input gradients ("can't steal_bwd_input if
        this stage doesn't have backward"): under it each micro batch goes through the stages in
        order instead (:func:`_forward_in_stage_order`)."""
        losses: list[torch.Tensor] = []
        if isinstance(self.schedule, schedule_class("ZBVZeroBubble")):
            for micro_batch in micro_batches:
                inputs, targets, extra = prepare(*micro_batch)
                logits = _forward_in_stage_order(self.stages, inputs, extra)
                if logits is not None:  # this rank holds the last stage
                    losses.append(self.loss_fn(logits, targets))
            return losses
        for inputs, targets, extra in self._schedule_steps(micro_batches, prepare):
            chunk_losses: list[torch.Tensor] = []  # filled on the rank holding the last stage only
            self.schedule.eval(*([inputs] if self.has_first_stage else []), target=targets, losses=chunk_losses,
                               **extra)
            losses += chunk_losses
        return losses

    def _schedule_steps(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], prepare: Prepare):
        """The micro batches in groups of ``self.microbatches``, each concatenated (inputs, targets and
        any sample ids) and prepared."""
        for k in range(0, len(micro_batches), self.microbatches):
            chunk = micro_batches[k : k + self.microbatches]
            yield prepare(*(torch.cat(parts) for parts in zip(*chunk)))


_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the hidden states sent between stages


def _forward_in_stage_order(stages: list, inputs: torch.Tensor, extra: dict) -> torch.Tensor | None:
    """One micro batch through every stage in order: the last stage's output on the rank that runs
    it, None on the others. Every pp rank walks the same stage order (the schedule's stage-to-rank
    map), so the blocking sends and receives pair up; consecutive stages on one rank (the turn of a
    V) hand over locally."""
    owners = stages[0].stage_index_to_group_rank
    me, group = stages[0].group_rank, stages[0].group
    modules = {stage.stage_index: stage.submod for stage in stages}
    hidden = None
    for index in range(stages[0].num_stages):
        owner, previous = owners[index], owners[index - 1] if index else None
        if owner == me:
            if index == 0:
                hidden = inputs
            elif previous != me:
                hidden = _receive(previous, group, inputs.device)
            hidden = modules[index](hidden, **extra)
        elif previous == me:
            _send(hidden, owner, group)
    return hidden if owners[stages[0].num_stages - 1] == me else None


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


def num_stages(parallel) -> int:
    return parallel.pp * stages_per_rank(parallel.pp_schedule, parallel.pp_stages_per_rank)


def build_parts(cfg: ModelConfig, parallel, pp_rank: int) -> list[tuple[int, Transformer]]:
    """(stage index, stage module on meta) for each stage this pp rank runs."""
    total = num_stages(parallel)
    split = layer_split(cfg.n_layers, total, parallel.pp_layers_per_stage)
    ids = stage_ids(pp_rank, parallel.pp, total // parallel.pp, parallel.pp_schedule)
    return [(i, stage_model(cfg, i, total, split[i])) for i in ids]


def build_schedule(parts: list[tuple[int, nn.Module]], num_stages: int, schedule: str, microbatches: int,
                   loss_fn, device: torch.device, pp_group) -> Pipeline:
    """PipelineStages for the (parallelized, materialized) parts, driven by ``schedule``.

    Gradients are not scaled by the schedule: the loss is already normalized by the global
    batch's token count, so summing the microbatches' gradients is exact.
    """
    from torch.distributed.pipelining import PipelineStage

    stages = [PipelineStage(module, index, num_stages, device, group=pp_group) for index, module in parts]
    cls = schedule_class(schedule)
    runner = cls(stages[0] if is_single_stage(schedule) else stages, microbatches, loss_fn=loss_fn,
                 scale_grads=False)
    return Pipeline([module for _, module in parts], stages, runner, microbatches, loss_fn)


class TiedEmbeddings:
    """Keeps the first stage's embedding and the last stage's copy of it one matrix in effect.

    Both copies start equal (same parameter name, same seed); summing their gradients after
    backward gives each the gradient of the shared matrix, so identical optimizer steps keep them
    equal. The first and last stage share a rank under V schedules (a local sum); otherwise the
    two pp ranks of each (dp, tp) coordinate all-reduce over a group of two.
    """

    def __init__(self, parts: list[nn.Module], world: DeviceMesh, last_stage_on_first_rank: bool):
        self.params = [p.tok_embeddings.weight for p in parts if p.tok_embeddings is not None]
        # The last stage's copy: the same matrix again, so the gradient norm leaves it out.
        self.output_copies = [p.tok_embeddings.weight for p in parts
                              if p.tok_embeddings is not None and not p.embeds_input]
        self.group = None
        if not last_stage_on_first_rank:
            ends = world.mesh.reshape(world.mesh.shape[0], -1)  # pp is the outermost mesh dim
            for column in range(ends.shape[1]):  # every rank creates every group, in one order
                ranks = [int(ends[0, column]), int(ends[-1, column])]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    self.group = group

    @torch.no_grad()
    def sync_gradients(self) -> None:
        if not self.params or not self.params[0].requires_grad:  # frozen (LoRA): no gradient to sum
            return
        for p in self.params:  # under tp the embedding's gradient comes back replicated: shard it like p
            if is_dtensor(p.grad) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
        local = [local_tensor(p.grad) for p in self.params]
        total = local[0] if len(local) == 1 else local[0] + local[1]
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for grad in local:
            grad.copy_(total)
