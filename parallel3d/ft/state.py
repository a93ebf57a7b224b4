"""What a healing replica group copies from a live peer: everything that defines the run, bitwise.

Each rank sends its own shard of the state to the rank of the same group rank in the healing group
(both groups have one layout: the quorum refuses a group whose config differs). Tensors travel as
plain local tensors (a DTensor's shard), so the transport needs no mesh of the other group; the
receiver copies them into its own tensors in place. Parameters and persistent buffers (the MoE
routers' bias), the optimizer's moments and its param groups (the lr the scheduler set), the lr
scheduler, the RNG streams, the data position and the bad-step guard. Float8's precomputed scales
are a function of the weights and are recomputed after the copy.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
import torch

from parallel3d.base import local_tensor
from parallel3d.ft import FTError
from parallel3d.checkpoint.checkpointer import TrainState
from parallel3d.optim.adamw import init_optimizer_state
from parallel3d.parallel.float8 import precompute_float8_scales
from parallel3d.runtime.guard import BadStepGuard


@dataclass
class RunState:
    """The live objects a heal reads on the sender and writes on the receiver."""

    train: TrainState  # parts, optimizer, scheduler
    guard: BadStepGuard
    sampler: object  # its ``offset``: the data position beyond the step (rollbacks before ft took over)
    fingerprint: int  # of the config every group must share (membership.config_fingerprint)
    replica_id: int
    float8_all_gather: bool = False  # precomputed float8 scales to refresh after a copy


def _entries(state: TrainState, with_optimizer: bool) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor that defines the model and optimizer, in one order on every
    group of one layout (a tied copy appears twice: both copies are written)."""
    entries = [(name, p) for name, p in state.named_parameters()] + list(state.persistent_buffers().items())
    if with_optimizer:
        params = [q for group in state.optimizer.param_groups for q in group["params"]]
        entries += [(f"optimizer/{i}/{key}", value) for i, q in enumerate(params)
                    for key, value in state.optimizer.state.get(q, {}).items() if isinstance(value, torch.Tensor)]
    return entries


def state_digest(run: RunState) -> str:
    """A SHA-256 of this rank's whole run state as a heal copies it (tensors' bytes, schedule, lr,
    RNG, data position, guard): equal on the same rank of two groups iff their states are."""
    t = run.train
    digest = hashlib.sha256()
    for _, value in _entries(t, with_optimizer=bool(t.optimizer.state)):
        digest.update(local_tensor(value).detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    digest.update(torch.get_rng_state().numpy().tobytes())
    numbers = {"scheduler": t.scheduler.state_dict(), "lr": [g["lr"] for g in t.optimizer.param_groups],
               "data_offset": run.sampler.offset, "guard": run.guard.state_dict()}
    digest.update(json.dumps(numbers, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


def snapshot_state(run: RunState) -> dict:
    """``heal_state`` copied (tensors to the CPU): what ``apply_heal_state`` restores this rank to
    later, after a DiLoCo period whose sync failed."""
    state = heal_state(run)
    tensors = [t.to("cpu", copy=True) for t in state.pop("tensors")]
    return {**copy.deepcopy(state), "tensors": tensors}


def heal_state(run: RunState) -> dict:
    """This rank's state for a healing peer (called by torchft on the sender, in its quorum thread,
    while the training thread waits for the quorum: nothing changes underneath)."""
    t = run.train
    entries = _entries(t, with_optimizer=bool(t.optimizer.state))
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    guard = run.guard
    return {"replica_id": run.replica_id, "fingerprint": run.fingerprint,
            "names": [name for name, _ in entries], "tensors": [local_tensor(v).detach() for _, v in entries],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups],
            "scheduler": t.scheduler.state_dict(), "rng": rng, "data_offset": run.sampler.offset,
            "guard": {**guard.state_dict(), "bad_in_a_row": guard.bad_in_a_row}}


@torch.no_grad()
def apply_heal_state(run: RunState, sent: dict) -> None:
    """Make this rank's state the peer's ``sent`` state, bitwise. Raises FTError (one line) when
    the peer trains another config or another layout."""
    if sent["fingerprint"] != run.fingerprint:
        raise FTError(f"ft: replica group {sent['replica_id']} trains another config (model, global batch, "
                       f"optimizer, data or layout) than this group: nothing copied. Fix: start every replica "
                       f"group with the same config but ft.replica_id")
    t = run.train
    with_optimizer = any(name.startswith("optimizer/") for name in sent["names"])
    if with_optimizer:
        init_optimizer_state(t.optimizer)
    else:  # the peer's optimizer has not stepped yet: neither has this one now
        t.optimizer.state.clear()
    entries = _entries(t, with_optimizer)
    if [name for name, _ in entries] != sent["names"]:
        raise FTError(f"ft: the state of replica group {sent['replica_id']} does not match this group's tensors. "
                       f"Fix: start every replica group with the same config and layout")
    for (name, mine), theirs in zip(entries, sent["tensors"]):
        local = local_tensor(mine).detach()
        if local.shape != theirs.shape or local.dtype != theirs.dtype:
            raise FTError(f"ft: {name} is {tuple(theirs.shape)} {theirs.dtype} in replica group "
                           f"{sent['replica_id']}, {tuple(local.shape)} {local.dtype} here. Fix: one layout for all")
        local.copy_(theirs)
    for group, values in zip(t.optimizer.param_groups, sent["param_groups"]):
        group.update(values)
    t.scheduler.load_state_dict(sent["scheduler"])
    torch.set_rng_state(sent["rng"]["cpu"])
    if "cuda" in sent["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(sent["rng"]["cuda"])
    run.sampler.offset = sent["data_offset"]
    run.guard.load_state_dict(sent["guard"])
    run.guard.bad_in_a_row = sent["guard"]["bad_in_a_row"]
    if run.float8_all_gather:
        precompute_float8_scales(t.parts)
