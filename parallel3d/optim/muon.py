"""Muon for the blocks' weight matrices, AdamW for everything else (``optim.name=muon``).

Muon (Keller Jordan; "Muon is Scalable for LLM Training", Moonshot) replaces each matrix's
momentum by its nearest semi-orthogonal matrix, computed by a few Newton–Schulz iterations. The
update is the one ``torch.optim.Muon`` computes (tests/test_muon.py holds the two together), but
torch's takes whole 2-D tensors on one device; here a parameter may be a DTensor split by FSDP,
tensor or expert parallelism, or a stack of experts (E, out, in).

Which parameters (:func:`is_muon_parameter`, docs/optimizers.md): the matrices of the transformer
blocks, attention and MLP projections, each expert's matrix on its own. The embedding, the output
head, norms, routers and biases stay with AdamW.

Distributed: the momentum is elementwise, so it lives sharded like its parameter and is updated
on the local shard (a checkpoint reshards it as it does AdamW's moments). Newton–Schulz needs the
whole matrix: the update is cast to bfloat16 (as Newton–Schulz's first step does anyway), and
each rank of the group that holds a matrix's pieces orthogonalises its share of the group's
matrices whole, the pieces travelling to their owner and back (``orthogonalise.py``). A rank
that holds whole matrices (split along the expert dim only, or not at all) orthogonalises them
itself. Every layout therefore applies the update one process computes.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parallel3d.base import ConfigError, local_tensor
from parallel3d.optim.adamw import implementation_flags, named_decay_groups
from parallel3d.optim.orthogonalise import SharedNewtonSchulz

OPTIMIZERS = ("adamw", "muon")  # optim.name
ADJUST_LR_FNS = ("original", "match_rms_adamw")  # optim.muon.adjust_lr_fn
# Parameter names that are never Muon's although they are matrices inside a block: the MoE router.
NOT_MUON = ("router",)


def is_muon_parameter(name: str, ndim: int) -> bool:
    """Muon's: the matrices (2-D, or a stack of experts' matrices, 3-D) inside the transformer
    blocks (``layers.*``), except the routers. The embedding and output head are matrices too, but
    Muon is for hidden layers: they stay with AdamW, as do norms and biases (1-D). ``ndim``: the
    parameter's (the planner asks with shapes, not tensors)."""
    parts = name.split(".")  # a pipeline rank's stages prefix their index: 0.layers.3.attention.wq.weight
    return "layers" in parts and ndim in (2, 3) and not any(part in parts for part in NOT_MUON)


def check_muon_config(m) -> None:
    """ConfigErrors for optim.muon.* (called by validate.check, whatever optim.name says)."""
    if m.adjust_lr_fn not in ADJUST_LR_FNS:
        raise ConfigError("optim.muon.adjust_lr_fn", m.adjust_lr_fn, "unknown learning-rate adjustment",
                          f"use one of {', '.join(ADJUST_LR_FNS)}")
    if m.lr is not None and m.lr <= 0:
        raise ConfigError("optim.muon.lr", m.lr, "must be > 0", "use a positive learning rate, or null for optim.lr")
    if m.weight_decay is not None and m.weight_decay < 0:
        raise ConfigError("optim.muon.weight_decay", m.weight_decay, "must be >= 0",
                          "use e.g. 0.1, or null for optim.weight_decay")
    if not 0 <= m.momentum < 1:
        raise ConfigError("optim.muon.momentum", m.momentum, "must lie in [0, 1)", "use e.g. 0.95")
    if len(m.ns_coefficients) != 3:
        raise ConfigError("optim.muon.ns_coefficients", list(m.ns_coefficients), "Newton–Schulz's quintic takes "
                          "three coefficients (a, b, c)", "use e.g. [3.4445, -4.775, 2.0315]")
    if not 1 <= m.ns_steps < 100:
        raise ConfigError("optim.muon.ns_steps", m.ns_steps, "must lie in 1..99", "use e.g. 5")
    if m.eps <= 0:
        raise ConfigError("optim.muon.eps", m.eps, "must be > 0", "use e.g. 1e-7")


def build_muon_adamw(model: nn.Module, optim) -> MuonWithAdamW:
    """Muon over the model's block matrices, AdamW (as ``optim.name=adamw`` builds it) over the
    rest. ``optim.muon.lr`` and ``optim.muon.weight_decay`` default to AdamW's (null). A pipeline
    stage without blocks leaves Muon a group without parameters (torch refuses no group at all)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    matrices = [p for name, p in named if is_muon_parameter(name, p.ndim)]
    rest = [(name, p) for name, p in named if not is_muon_parameter(name, p.ndim)]
    m = optim.muon
    muon = Muon([{"params": matrices}], lr=optim.lr if m.lr is None else m.lr,
                weight_decay=optim.weight_decay if m.weight_decay is None else m.weight_decay,
                momentum=m.momentum, nesterov=m.nesterov, ns_coefficients=tuple(m.ns_coefficients), eps=m.eps,
                ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr_fn)
    adamw = torch.optim.AdamW(named_decay_groups(rest, optim.weight_decay, optim.no_decay), lr=optim.lr,
                              betas=(optim.beta1, optim.beta2), eps=optim.eps,
                              **implementation_flags(optim.implementation, [p for _, p in rest]))
    return MuonWithAdamW(muon, adamw)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon and AdamW as one optimizer: one list of parameter groups (Muon's first), which the
    lr scheduler drives, one state dict (the two hold different parameters), one step. Whatever
    skips ``step`` (a bad step) skips both."""

    def __init__(self, muon: Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        groups = [*muon.param_groups, *adamw.param_groups]
        super().__init__(groups, {})  # the same group dicts: the scheduler's lr reaches both
        muon.state = adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


class Muon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update for parameters that may be DTensors and stacks of experts'
    matrices (the last two dims are a matrix; the leading one, if any, counts experts)."""

    def __init__(self, params, *, lr: float, weight_decay: float, momentum: float, nesterov: bool,
                 ns_coefficients: tuple[float, float, float], eps: float, ns_steps: int, adjust_lr_fn: str):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        super().__init__(params, defaults)
        self.orthogonaliser = SharedNewtonSchulz()  # keeps each group's exchange plan between steps

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon takes no closure"
        params, updates, groups = [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:  # sharded like the parameter: DCP reshards it
                    state["momentum_buffer"] = torch.zeros_like(p)
                params.append(p)
                groups.append(group)
                updates.append(_momentum_update(p.grad, state["momentum_buffer"], group))

        def orthogonalise(matrix: torch.Tensor, item: int) -> torch.Tensor:
            g = groups[item]
            return newton_schulz(matrix, g["ns_coefficients"], g["ns_steps"], g["eps"])

        for p, ortho, group in zip(params, self.orthogonaliser(params, updates, orthogonalise), groups):
            _apply_update(p, ortho, group)


def _momentum_update(grad: torch.Tensor, buf: torch.Tensor, group: dict) -> torch.Tensor:
    """The momentum step on this rank's shard, in torch.optim.Muon's order of operations, and the
    update Newton–Schulz takes, cast to bfloat16 (its first step casts to it anyway: the exchange
    moves half the bytes for the same result)."""
    local_grad, local_buf = local_tensor(grad), local_tensor(buf)
    momentum = group["momentum"]
    local_buf.lerp_(local_grad, 1 - momentum)
    update = local_grad.lerp(local_buf, momentum) if group["nesterov"] else local_buf
    return update.bfloat16()


def _apply_update(param: torch.Tensor, ortho: torch.Tensor, group: dict) -> None:
    """Decoupled weight decay and the orthogonalised update, on this rank's shard."""
    local_param, lr = local_tensor(param), group["lr"]
    adjusted_lr = adjust_lr(lr, group["adjust_lr_fn"], param.shape[-2:])
    local_param.mul_(1 - lr * group["weight_decay"])
    local_param.add_(ortho, alpha=-adjusted_lr)


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """The quintic Newton–Schulz iteration of ``torch.optim.Muon`` (same operations, same order,
    in bfloat16): an approximately semi-orthogonal matrix U S' V^T from ``matrix`` = U S V^T."""
    a, b, c = coefficients
    x = matrix.bfloat16()
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjust_lr(lr: float, adjust_lr_fn: str, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate: ``original`` scales by sqrt(max(1, rows / cols)) (Keller
    Jordan's); ``match_rms_adamw`` by 0.2 sqrt(max(rows, cols)), so the update's RMS matches AdamW's
    and AdamW's learning rate and weight decay carry over (Moonshot's)."""
    rows, cols = shape
    if adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))
