"""One rank's training state, built one way for ``train()`` and for the dry run, and the step.

``build_setup`` goes from a validated config and a device to a :class:`Setup`: the meshes, the
model (whole, or this rank's pipeline stages with their schedule), the tied-embedding link, the
optimizer, the lr scheduler and the loss. ``train_step(setup, micro_batches)`` runs one
optimizer step on it. ``train.train`` feeds it real batches; ``dryrun.run_rank`` builds the same
Setup inside FakeTensorMode and runs the same step on fake ones.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from parallel3d.base import is_dtensor
from parallel3d.config.fault_tolerance import batch_share
from parallel3d.config.schema import Config
from parallel3d.data import BatchSpec
from parallel3d.data.documents import document_inputs, document_positions
from parallel3d.models import Transformer
from parallel3d.optim.adamw import build_optimizer
from parallel3d.optim.clip import clip_grad_norm_, perturb_gradients, settle_gradients
from parallel3d.optim.muon import build_muon_adamw
from parallel3d.optim.schedule import build_lr_scheduler
from parallel3d.parallel.compose import ParallelPlan, parallelize
from parallel3d.parallel.context import shard_batch
from parallel3d.parallel.data import set_gradient_sync
from parallel3d.parallel.expert import ExpertLoads, configure_moe, reduce_expert_loads, update_router_bias
from parallel3d.parallel.float8 import precompute_float8_scales
from parallel3d.parallel.mesh import Meshes, ParallelDims, build_mesh
from parallel3d.parallel.pipeline import V_SCHEDULES, Pipeline, TiedEmbeddings, build_parts, build_schedule, num_stages
from parallel3d.runtime.guard import BadStepGuard, poison

# (inputs, targets), or for packed instruction data (inputs, targets, sample ids): each (b, s)
MicroBatches = list[tuple[torch.Tensor, ...]]


@dataclass
class Setup:
    """Everything one optimizer step reads, for this rank."""

    config: Config
    device: torch.device
    dims: ParallelDims
    meshes: Meshes
    spec: BatchSpec  # this rank's share of the global batch
    model: nn.Module  # the whole model, or a ModuleList of this rank's pipeline stages
    pipeline: Optional[Pipeline]
    tied: Optional[TiedEmbeddings]  # the embedding's copy on the last stage, under pp with tied embeddings
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_fn: TokenLoss

    @property
    def parts(self) -> list[nn.Module]:
        """The modules a checkpoint saves: the model, or each pipeline stage."""
        return [self.model] if self.pipeline is None else self.pipeline.parts


def _summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over the trained targets (-100: untrained; none trained: exactly 0)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum", ignore_index=-100)


class TokenLoss:
    """Summed cross entropy over ``divisor``, the global batch's trained targets per data-parallel
    x context-parallel rank: summed over micro batches and averaged over those ranks (as their
    gradients are), it is the mean over every trained target of the global batch, whatever the
    layout. For text every target is trained and the divisor is fixed; instruction data sets it
    each step (``train_step``'s ``trained_tokens``), also for the pipeline schedule, which holds
    this object."""

    def __init__(self, tokens_per_rank: int, ranks: int, compile: bool):
        self.tokens_per_rank, self.ranks = tokens_per_rank, ranks
        self.divisor: float = tokens_per_rank
        # Compiled, the float32 upcast fuses into the loss: no float32 copy of the vocabulary-wide logits.
        self._summed = torch.compile(_summed_cross_entropy) if compile else _summed_cross_entropy

    def set_trained_tokens(self, trained_tokens: int | None) -> None:
        """The global batch's trained targets (None: all of them, the fixed divisor). A batch
        without any has loss 0 and no gradient, never 0/0."""
        self.divisor = self.tokens_per_rank if trained_tokens is None else max(trained_tokens, 1) / self.ranks

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._summed(logits, targets) / self.divisor


def build_setup(c: Config, device: torch.device,
                materialize: contextlib.AbstractContextManager | None = None) -> Setup:
    """Meshes, parallelized model, optimizer and scheduler for this rank of a validated config.
    ``materialize``: the context parameters and optimizer state get their memory in (the dry
    run's FakeTensorMode); None: real memory on ``device``."""
    t = c.train
    dims = ParallelDims.from_config(c.parallel)
    meshes = build_mesh(dims, device.type, c.parallel.ep, mixed_precision=c.train.param_dtype != "float32")
    share, shares = batch_share(c)  # under ft.enabled: this replica group's slice of the global batch
    spec = BatchSpec(t.global_batch_size, t.micro_batch_size, t.seq_len, share * dims.dp + meshes.dp_rank,
                     shares * dims.dp)
    # a cp rank holds 1/cp of each of its sequences' tokens
    loss_fn = TokenLoss(spec.local_batch_size * t.seq_len // dims.cp, shares * dims.dp * dims.cp, c.model.compile)
    microbatches = c.parallel.pp_microbatches or spec.num_micro_batches
    model, pipeline, tied = build_model(c, meshes, device, microbatches, loss_fn, materialize)
    configure_moe([model] if pipeline is None else pipeline.parts, spec.local_batch_size, meshes.cp_tp, dims.cp)
    with materialize or contextlib.nullcontext():
        optimizer = build_muon_adamw(model, c.optim) if c.optim.name == "muon" else build_optimizer(model, c.optim)
        scheduler = build_lr_scheduler(optimizer, c.optim, t.steps)
    return Setup(c, device, dims, meshes, spec, model, pipeline, tied, optimizer, scheduler, loss_fn)


def build_model(c: Config, meshes: Meshes, device: torch.device, microbatches: int, loss_fn,
                materialize: contextlib.AbstractContextManager | None = None):
    """This rank's model, parallelized and initialized: the whole model, or its pipeline stages
    (a ModuleList) with their schedule and, for tied embeddings, the link between the copies.
    Parallelizing happens outside ``materialize``: DeviceMesh slicing computes on real tensors."""
    if meshes.pp is not None:  # this rank's pipeline stages, each a slice of the model on meta
        staged = build_parts(c.model, c.parallel, meshes.pp.get_local_rank())
    else:
        with torch.device("meta"):
            staged = [(0, Transformer(c.model))]
    plan = ParallelPlan.from_config(c)
    for _, part in staged:
        parallelize(part, meshes, plan)
        with materialize or contextlib.nullcontext():
            part.to_empty(device=device)
            part.init_weights(c.train.seed)
    if meshes.pp is None:
        return staged[0][1], None, None
    pipeline = build_schedule(staged, num_stages(c.parallel), c.parallel.pp_schedule, microbatches, loss_fn, device,
                              meshes.pp.get_group())
    tied = None
    if c.model.tie_embeddings:  # the embedding on the first stage, its copy on the last
        tied = TiedEmbeddings(pipeline.parts, meshes.world, c.parallel.pp_schedule in V_SCHEDULES)
    return torch.nn.ModuleList(pipeline.parts), pipeline, tied


class ReplicaSync(Protocol):
    """Fault tolerance's part of a step (parallel3d/ft/): what crosses the replica groups."""

    def average_gradients(self, params: list[torch.Tensor], loss_sum: torch.Tensor) -> None:
        """Gradients (after this group's own reduction) and the loss, averaged over the live groups."""

    def average(self, tensor: torch.Tensor) -> None:
        """A step statistic every group must agree on (the MoE loads the router bias follows)."""

    def commit(self) -> bool:
        """The vote of every group: False discards the step on all of them (no update, no lr step)."""

    def after_update(self) -> None:
        """After the update (DiLoCo: at a period's end, the groups' sync and outer step)."""


class StepResult(NamedTuple):
    loss_sum: torch.Tensor  # this rank's summed loss
    grad_norm: torch.Tensor
    expert_loads: ExpertLoads | None  # over every rank (None: a dense model)


def train_step(setup: Setup, micro_batches: MicroBatches, *, guard: BadStepGuard | None = None,
               trained_tokens: int | None = None, replicas: ReplicaSync | None = None) -> StepResult:
    """One optimizer step over this rank's micro batches: forward and backward (through the pipeline
    schedule under pp), the tied embeddings' gradient sum, global-norm clipping, the optimizer step,
    the sigmoid MoE routers' bias step and the lr step. ``guard`` decides with every rank, before the
    optimizer, whether the update happens (a bad step: no optimizer or bias step on any rank; the lr
    schedule advances). ``trained_tokens``: the global batch's trained targets (instruction data:
    the sampler's ``trained_tokens``); None: every target. ``replicas`` (ft.enabled): the step's
    gradients averaged over the replica groups, and their vote to commit it. Returns this rank's summed loss, the
    gradient norm and the step's expert loads; the gradients stay for the caller to measure and zero."""
    s, c = setup, setup.config
    s.loss_fn.set_trained_tokens(trained_tokens)
    # Under tensor parallelism the logits stay sharded over the vocabulary; the loss and its
    # backward are computed on the shards.
    vocab_parallel = loss_parallel_context() if s.meshes.tp is not None else contextlib.nullcontext()
    with vocab_parallel:
        if s.pipeline is None:
            losses = _forward_backward(s, micro_batches)
        else:
            losses = s.pipeline.forward_backward(micro_batches, lambda *batch: rank_batch(s, *batch))
    loss_sum = torch.zeros((), device=s.device)
    for loss in losses:
        loss_sum += whole_loss(loss)
    # The optimizer's list is the model's trainable parameters: reading it spares walking the
    # module tree every step.
    params = [p for group in s.optimizer.param_groups for p in group["params"]]
    if guard is not None and guard.inject_nan:  # debug.nan_steps
        poison(loss_sum, params)
    settle_gradients(params)
    if replicas is not None:  # after the group's own reduction, before the norm: every group clips alike
        replicas.average_gradients(params, loss_sum)
    if c.debug.grad_noise:  # the parity tests' perturbed reference (one process): before the norm, as round-off
        perturb_gradients(params, relative=c.debug.grad_noise, seed=c.train.seed, draw=c.debug.grad_noise_draw,
                          step=s.scheduler.last_epoch + 1)
    if s.tied is not None:
        s.tied.sync_gradients()
    grad_norm = clip_grad_norm_(params, c.train.grad_clip, uncounted=s.tied.output_copies if s.tied else (),
                                pp_group=s.meshes.pp.get_group() if s.meshes.pp is not None else None)
    # One reduction of the step's expert loads feeds the metrics and the sigmoid routers' bias.
    expert_loads = reduce_expert_loads(s.parts, c.model, micro_batches=len(micro_batches), device=s.device,
                                       world_group_size=dist.get_world_size() if dist.is_initialized() else 1)
    if replicas is not None:
        if expert_loads is not None:
            replicas.average(expert_loads.loads)
        if not replicas.commit():  # some group failed this step: discarded on all, to be trained again
            return StepResult(loss_sum, grad_norm, expert_loads)
    if guard is None or guard.update_allowed(loss_sum, grad_norm):
        s.optimizer.step()
        update_router_bias(s.parts, c.model, expert_loads)  # steers expert choice by this step's load
        if c.train.float8_fsdp_all_gather:  # the next all-gathers' float8 scales, in one all-reduce
            precompute_float8_scales([s.model])
    s.scheduler.step()
    if replicas is not None:
        replicas.after_update()
    return StepResult(loss_sum, grad_norm, expert_loads)


def whole_loss(loss: torch.Tensor) -> torch.Tensor:
    """A micro batch's loss as a plain tensor: under loss parallelism (tp) it is a replicated
    DTensor, the same whole value on every rank."""
    return loss.full_tensor() if is_dtensor(loss) else loss


def loss_parallel_context() -> contextlib.AbstractContextManager:
    """torch's loss_parallel, imported where tensor parallelism runs (DTensor's import is not free)."""
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def reduce_loss(meshes: Meshes, loss_sum: torch.Tensor) -> torch.Tensor:
    """The loss over the global batch from each rank's ``loss_sum`` (a sum over its micro batches of
    losses already divided by the global batch's trained tokens per data-parallel x context-parallel
    rank): the last pipeline stage's, summed over pp (only it computed a loss), averaged over dp x cp.
    A collective of every rank; ``loss_sum`` is left as it is."""
    loss = loss_sum.clone()
    if meshes.pp is not None:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=meshes.pp.get_group())
    if meshes.dp_cp is not None:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=meshes.dp_cp.get_group())
    return loss


def rank_batch(s: Setup, inputs: torch.Tensor, targets: torch.Tensor, sample_ids: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """A micro batch as this rank's model takes it: on the device, the document ids and positions
    (``data.document_masking``, ``data.reset_positions``) read off the whole sequences, or for
    packed instruction data its samples (``sample_ids``: attention stays inside each sample,
    positions restart at each), then every (b, s) tensor cut to this context-parallel rank's share
    of the sequence."""
    inputs, targets = inputs.to(s.device, non_blocking=True), targets.to(s.device, non_blocking=True)
    if sample_ids is not None:
        sample_ids = sample_ids.to(s.device, non_blocking=True)
        extra = {"doc_ids": sample_ids, "positions": document_positions(sample_ids)}
    elif s.config.data.format == "text":
        extra = document_inputs(inputs, s.config.data)
    else:  # one sample a row, from position 0, padding after it: causal attention is all it needs
        extra = {}
    inputs, targets, *values = shard_batch(s.meshes.cp, inputs, targets, *extra.values())
    return inputs, targets, dict(zip(extra, values))


def _forward_backward(s: Setup, micro_batches: MicroBatches) -> list[torch.Tensor]:
    """Without pipeline parallelism: each micro batch forward and backward, gradients accumulating."""
    losses = []
    for i, micro_batch in enumerate(micro_batches):
        if s.meshes.data_parallel is not None:  # the data-parallel wrapper reduces on the last micro batch only
            set_gradient_sync(s.model, i == len(micro_batches) - 1, s.config.parallel.zero_stage)
        inputs, targets, extra = rank_batch(s, *micro_batch)
        loss = s.loss_fn(s.model(inputs, **extra), targets)
        loss.backward()
        losses.append(loss.detach())
    return losses
