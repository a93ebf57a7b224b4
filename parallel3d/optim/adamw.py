"""Optimizer, learning-rate schedules and global gradient-norm clipping."""

from __future__ import annotations

import math
from fnmatch import fnmatch
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

LR_SCHEDULES = ("cosine", "wsd", "constant")  # optim.schedule
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")  # optim.implementation


def build_optimizer(model: nn.Module, optim) -> torch.optim.Optimizer:
    """AdamW over the model's parameters (this rank's shards of them, under ZeRO), in two groups:
    weight decay for most, none for those ``optim.no_decay`` names (see :func:`decay_groups`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(decay_groups(model, optim.weight_decay, optim.no_decay), lr=optim.lr,
                             betas=(optim.beta1, optim.beta2), eps=optim.eps,
                             **implementation_flags(optim.implementation, params))


def decay_groups(model: nn.Module, weight_decay: float, no_decay) -> list[dict]:
    """AdamW parameter groups: parameters whose name matches a glob pattern of ``no_decay``
    (``fnmatch`` on names such as ``layers.0.ffn_norm.weight``) get no weight decay, the rest
    ``weight_decay``. Empty groups are left out (a pipeline stage may hold no norm)."""
    return named_decay_groups(model.named_parameters(), weight_decay, no_decay)


def named_decay_groups(named_parameters, weight_decay: float, no_decay) -> list[dict]:
    """:func:`decay_groups` of some (name, parameter) pairs (those AdamW takes beside Muon)."""
    decay, exempt = [], []
    for name, p in named_parameters:
        if p.requires_grad:
            (exempt if any(fnmatch(name, pattern) for pattern in no_decay) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def implementation_flags(implementation: str, params) -> dict:
    """AdamW's keyword for ``optim.implementation``. ``auto`` is fused wherever torch has the kernel
    (CUDA and CPU among others): one kernel for all tensors, faster than the for-loop and
    foreach updates (BENCHMARKS.md has the figures), and its step counters stay on the device, so the update
    reads nothing back to the host (torch's own default, foreach on CUDA, reads them there)."""
    if implementation == "auto":
        fused = {d.type for d in (p.device for p in params)} <= set(_get_fused_kernels_supported_devices())
        return {"fused": True} if fused and all(p.is_floating_point() for p in params) else {}
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors as its first step would (a step at lr 0 on zero
    gradients), so a checkpoint can be loaded into them, or a dry run measure a later step."""
    if optimizer.state:
        return
    params = [q for group in optimizer.param_groups for q in group["params"]]
    for q in params:
        q.grad = torch.zeros_like(q)
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def lr_factor(step: int, *, steps: int, warmup: int, schedule: str, min_ratio: float, decay_fraction: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based, as LambdaLR counts)."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":  # from the peak (once, at the last warmup step) to min_ratio at the last step
        peak = max(warmup - 1, 0)
        progress = (step - peak) / max(steps - 1 - peak, 1)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    # wsd: warmup, stable, then linear decay that reaches min_ratio when the run ends, i.e. after
    # its last update: every decay step still trains (with min_ratio=0 the last step is not at lr 0).
    decay_steps = max(int(round(decay_fraction * steps)), 1)
    decay_start = steps - decay_steps
    if step < decay_start:
        return 1.0
    return 1 - (1 - min_ratio) * min((step - decay_start + 1) / (decay_steps + 1), 1.0)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    factor = partial(lr_factor, steps=steps, warmup=optim.warmup_steps, schedule=optim.schedule,
                     min_ratio=optim.min_lr_ratio, decay_fraction=optim.decay_fraction)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def set_schedule_step(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Put the schedule after ``step`` optimizer steps, as this run's config defines it.

    A resumed run does not load the scheduler's saved state: the learning rate is a pure function
    of (step, config), so a changed optim.lr, schedule, warmup, min_lr_ratio or train.steps
    applies from the next step (a loaded LambdaLR state would keep the old values)."""
    scheduler.last_epoch = step
    lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() returns; LambdaLR has no public setter


@torch.no_grad()
def settle_gradients(params) -> None:
    """Give each DTensor gradient its parameter's placements, once, after backward.

    Under tensor parallelism without a data-parallel wrapper (which does this as it reduces),
    autograd leaves the gradients of replicated weights (the norms, under sequence parallelism)
    ``Partial``: every later read (the norm, then each of AdamW's three uses) would all-reduce
    them again. A gradient that comes back whole where its parameter is sharded is cut to this
    rank's shard, a local slice.
    """
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, pp_group=None, uncounted=()) -> torch.Tensor:
    """Clip to a global norm over every shard of every gradient; returns the norm before clipping
    (float64: see :func:`total_norm`).

    Sharded (DTensor) gradients give a partial norm per rank; ``full_tensor()`` reduces it over
    the mesh, so each rank clips by the same, global, value. (A rank's gradients are all DTensors
    or all plain tensors: parallel/tensor.py makes every tensor-parallel parameter a DTensor.)
    Under pipeline parallelism the squares of every stage's norm are summed over ``pp_group``.
    ``max_norm=0`` only measures. ``uncounted`` parameters (a second copy of a tied matrix) are
    clipped but not counted again.
    """
    with_grad = [p for p in params if p.grad is not None]  # torch's clip_grad_norm_ takes a generator too
    skip = {id(p) for p in uncounted}
    # DTensor ops take one mesh: expert-parallel experts live on the ep mesh, the rest on the dp one.
    by_mesh = _by_mesh([p for p in with_grad if id(p) not in skip])
    norms = [total_norm([p.grad for p in group]) for group in by_mesh]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    norm = norms[0] if len(norms) == 1 else torch.stack(norms).square().sum().sqrt()
    if pp_group is not None:  # each pipeline rank holds other layers: add their squares
        norm = norm**2
        dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=pp_group)
        norm = norm.sqrt()
    if max_norm > 0:
        for group in _by_mesh(with_grad):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` as one vector, accumulated in float64 (a DTensor's: partial per rank).

    torch's ``get_total_norm`` sums the per-tensor norms in the gradients' dtype: in float32 its
    rounding depends on how many terms each rank sums, so layouts would clip by norms a few ulps
    apart, which AdamW at a small eps amplifies after a loss spike. In float64 every layout's norm
    agrees to float32 rounding."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float64)))


def _by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped by their gradient's DeviceMesh (plain tensors: one group), in first-seen order."""
    groups: dict = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return list(groups.values()) or [[]]
