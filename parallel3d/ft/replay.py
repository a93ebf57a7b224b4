"""A fault-tolerant run's weights recomputed in one process from its membership log: the oracle.

Every committed step of the log trained the slices of the global batch its participants held;
replayed, the same step trains exactly those rows (the sampler's batch of that step, one process,
no replica groups), its loss the mean over their tokens, as the groups' averaged gradient is.
Equal weights (to float32 round-off) mean the run trained what its log says: no step twice, none
lost, no slice trained that was dropped, the optimizer and schedule healed with the right state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from parallel3d.data import BatchSpec, build_train_data
from parallel3d.ft.membership import read_membership
from parallel3d.step import Setup, build_setup, train_step


def one_process_config(c):
    """``c`` (a Config) for one process: the same model, data, optimizer and global batch, without
    replica groups or parallel degrees."""
    parallel = dataclasses.replace(c.parallel, dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, ep=1)
    return dataclasses.replace(c, parallel=parallel, ft=dataclasses.replace(c.ft, enabled=False))


def replay(c, logs: list[Path]) -> Setup:
    """Train a one-process Setup of ``c`` through the steps ``logs`` (membership.jsonl files of the
    run's groups) record; returns it. Raises ValueError when the log skips a step."""
    if c.ft.semi_sync == "diloco":
        raise ValueError("a DiLoCo run: replay it with replay_diloco")
    c = one_process_config(c)
    steps = read_membership(logs)
    if list(steps) != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, max(steps) + 1)) - set(steps))
        raise ValueError(f"the membership logs lack steps {missing[:10]}: replay the logs of every group")
    setup = build_setup(c, torch.device("cpu"))
    sampler = _sampler(c)
    torch.manual_seed(c.train.seed)
    for step, entry in steps.items():
        _train_slices(setup, sampler, step, entry["trained_slices"], entry["slice_rows"])
    return setup


def replay_diloco(c, logs: list[Path]) -> list[Setup]:
    """``ft.semi_sync=diloco`` simulated in one process: one Setup per replica group, each trains its
    slice with its own optimizer, and at every ``ft.diloco.inner_steps``-th step the mean of their
    pseudo-gradients takes the outer Nesterov step (a period whose sync failed goes back to the
    last sync's weights). Returns the replicas' Setups. Runs with heals are refused (ValueError):
    which peer a heal copied from is not in the log."""
    from parallel3d.ft.diloco import OuterStep

    steps = read_membership(logs)
    if any(e["healed"] for e in steps.values()):
        raise ValueError("the log has heals: replay_diloco simulates runs without them")
    d, c = c.ft.diloco, one_process_config(c)
    groups = [build_setup(c, torch.device("cpu")) for _ in range(c.ft.replicas)]
    outers = [OuterStep(_params(s), lr=d.outer_lr, momentum=d.outer_momentum) for s in groups]
    sampler = _sampler(c)
    torch.manual_seed(c.train.seed)
    for step, entry in steps.items():
        for r in entry["participants"]:
            _train_slices(groups[r], sampler, step, [r], entry["slice_rows"])
        if step % d.inner_steps:
            continue
        kept = entry["trained_slices"]
        if kept:
            pseudo = [outers[r].pseudo_gradients() for r in kept]
            mean = [sum(parts) / len(kept) for parts in zip(*pseudo)]
        for r in entry["participants"]:
            if kept:
                outers[r].step([m.clone() for m in mean])
            else:
                outers[r].restore()
    return groups


def _params(setup: Setup) -> list[torch.Tensor]:
    return [q for group in setup.optimizer.param_groups for q in group["params"]]


def _sampler(c):
    t = c.train
    return build_train_data(c.data, c.eval, BatchSpec(t.global_batch_size, t.micro_batch_size, t.seq_len), t.seed)[1]


def _train_slices(setup: Setup, sampler, step: int, slices: list[int], slice_rows: int) -> None:
    """One optimizer step of ``setup`` on the rows of the global batch of ``step`` that ``slices`` hold."""
    t = setup.config.train
    per_slice = slice_rows // t.micro_batch_size
    batches = sampler.micro_batches(step)
    trained = [batches[i] for s in slices for i in range(s * per_slice, (s + 1) * per_slice)]
    train_step(setup, trained, trained_tokens=len(trained) * t.micro_batch_size * t.seq_len)
    setup.optimizer.zero_grad(set_to_none=True)
