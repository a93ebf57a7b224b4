"""AdamW over the model's parameters in weight-decay groups, and its state created before a load."""

from __future__ import annotations

from fnmatch import fnmatch

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

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


