"""Learning-rate schedules: warmup, then cosine, warmup-stable-decay or constant; a pure function of (step, config)."""

from __future__ import annotations

import math
from functools import partial

import torch

LR_SCHEDULES = ("cosine", "wsd", "constant")  # optim.schedule


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
