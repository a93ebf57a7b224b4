"""What a checkpoint holds: a rank's training state, and the layout-independent keys of its tensors.

A parameter is saved under its full-model name (``layers.3.attention.wq.weight``) and each
optimizer state tensor as ``optimizer/<name>/<state>`` in the parameter's global shape, so DCP
reshards both to whatever dp/tp/pp the loader runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TrainState:
    """What a checkpoint saves and restores: this rank's model parts, optimizer and LR schedule."""

    parts: list[nn.Module]
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Full-model names, in the optimizer's order. A tied copy on a second part repeats a name."""
        return [(name, p) for part in self.parts for name, p in part.named_parameters()]

    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """State that is not a parameter but is trained (the sigmoid MoE router's balancing bias)."""
        return {f"{prefix}.{name}": buf for part in self.parts for prefix, module in part.named_modules()
                for name, buf in module._buffers.items()
                if buf is not None and name not in module._non_persistent_buffers_set}


def model_targets(state: TrainState, keys=lambda name, param: {name: param}) -> tuple[dict, list]:
    """DCP load targets: one tensor per key (loaded in place), and the duplicates to copy it into.
    ``keys``: the stored keys of a parameter and the tensors (it, or views of it) they load into."""
    targets, copies = {}, []
    for name, param in state.named_parameters():
        for key, target in keys(name, param.detach()).items():
            if key in targets:
                copies.append((target, targets[key]))
            else:
                targets[key] = target
    return targets, copies


def optimizer_entries(state: TrainState):
    """(key, state tensor) for each tensor of the optimizer state, keyed by its parameter's name
    (found by identity: the optimizer's groups, decay and no decay, order parameters otherwise)."""
    name_of = {id(p): name for name, p in state.named_parameters() if p.requires_grad}  # LoRA's base is frozen
    optimizer_params = [q for group in state.optimizer.param_groups for q in group["params"]]
    assert len(optimizer_params) == len(name_of), "the optimizer must hold exactly the parts' trainable parameters"
    for q in optimizer_params:
        name = name_of[id(q)]
        for key, value in state.optimizer.state.get(q, {}).items():
            if isinstance(value, torch.Tensor):
                yield f"optimizer/{name}/{key}", value


def state_dict(state: TrainState) -> dict[str, torch.Tensor]:
    tensors = {name: p.detach() for name, p in state.named_parameters()} | state.persistent_buffers()
    if state.optimizer is not None:
        tensors.update(optimizer_entries(state))
    return tensors


@torch.no_grad()
def finish_load(copies) -> None:
    """Fill each tied duplicate from the tensor loaded for its key."""
    for dest, src in copies:
        dest.copy_(src)


def scheduler_state(scheduler) -> dict | None:
    if scheduler is None:
        return None
    return scheduler.state_dict()  # plain numbers (a partial's lr_lambdas entry is its empty __dict__): JSON
