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
    c = one_process_config(c)
    steps = read_membership(logs)
    if list(steps) != list(range(1, len(steps) + 1)):
        missing = sorted(set(range(1, max(steps) + 1)) - set(steps))
        raise ValueError(f"the membership logs lack steps {missing[:10]}: replay the logs of every group")
    setup = build_setup(c, torch.device("cpu"))
    t = c.train
    spec = BatchSpec(t.global_batch_size, t.micro_batch_size, t.seq_len)
    _, sampler = build_train_data(c.data, c.eval, spec, t.seed)
    torch.manual_seed(t.seed)
    for step, entry in steps.items():
        per_slice = entry["slice_rows"] // t.micro_batch_size
        batches = sampler.micro_batches(step)
        trained = [batches[i] for s in entry["trained_slices"] for i in range(s * per_slice, (s + 1) * per_slice)]
        train_step(setup, trained, trained_tokens=len(trained) * t.micro_batch_size * t.seq_len)
        setup.optimizer.zero_grad(set_to_none=True)
    return setup
