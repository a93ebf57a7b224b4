"""``ft.semi_sync=diloco``: the groups synchronize every ``ft.diloco.inner_steps`` steps, not every step.

DiLoCo (Douillard et al., 2023): between syncs each group trains alone with its own (inner)
optimizer; at a sync every group's pseudo-gradient, the global weights of the last sync minus its
weights now, is averaged over the quorum (one all-reduce of each rank's shard) and an outer SGD
with Nesterov momentum moves the global weights by it; every group then continues from them. The
cross-group traffic is one all-reduce per ``inner_steps`` steps instead of one per step.

A sync that fails (a group died during the period) is voted down by torchft's commit, and every
group goes back to the state it had at the period's start (replica.py keeps a CPU copy) and
trains the period again with the quorum formed then.
"""

from __future__ import annotations

import torch

from parallel3d.base import local_tensor


class OuterStep:
    """The global weights (this rank's shards) and the outer Nesterov SGD over them."""

    def __init__(self, params: list[torch.Tensor], *, lr: float, momentum: float):
        self.params = params  # the model's trainable parameters, in the optimizer's order
        self.global_ = [local_tensor(p).detach().clone() for p in params]
        self.outer = torch.optim.SGD(self.global_, lr=lr, momentum=momentum, nesterov=True)

    @torch.no_grad()
    def pseudo_gradients(self) -> list[torch.Tensor]:
        """Global minus local, what the groups average."""
        return [g - local_tensor(p).detach() for g, p in zip(self.global_, self.params)]

    @torch.no_grad()
    def step(self, averaged: list[torch.Tensor]) -> None:
        """The outer step with the quorum's average, then every local weight set to the new global."""
        for g, d in zip(self.global_, averaged):
            g.grad = d
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self.restore()

    @torch.no_grad()
    def restore(self) -> None:
        """Local weights back to the global ones (after a step, or a sync that failed)."""
        for g, p in zip(self.global_, self.params):
            local_tensor(p).detach().copy_(g)

    def state_dict(self) -> dict:
        """For a healing peer: the global weights and the outer momentum."""
        momentum = [self.outer.state.get(g, {}).get("momentum_buffer") for g in self.global_]
        return {"global": list(self.global_), "momentum": momentum}

    @torch.no_grad()
    def load_state_dict(self, sent: dict) -> None:
        for g, theirs in zip(self.global_, sent["global"]):
            g.copy_(theirs)
        for g, theirs in zip(self.global_, sent["momentum"]):
            if theirs is None:
                self.outer.state.pop(g, None)
            else:
                self.outer.state[g]["momentum_buffer"] = theirs.clone()
