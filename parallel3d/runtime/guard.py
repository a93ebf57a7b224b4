"""Bad steps: one decision of all ranks, every step, before the optimizer moves anything.

A step is bad when its loss or gradient norm is not finite, or (``train.spike_factor`` > 0) when
its gradient norm exceeds ``spike_factor`` x the median norm of the last ``SPIKE_WINDOW`` good
steps. Each rank sees only part of the loss (its data-parallel share, the last pipeline stage's),
so a rank-local decision could update the weights on some ranks and not on others, and the next
collective would hang or mix states. :meth:`BadStepGuard.update_allowed` therefore all-reduces
two numbers per step over every rank (SUM of this rank's loss and of the gradient norm, which
clipping already made global: a non-finite loss anywhere makes the sum non-finite, and the norm
comes back identical on every rank). They are read on the host, where the rule is applied: one
host sync per step, before the optimizer step (a skip is a Python branch); the default
``logging.log_every=1`` already syncs once per step, after it, to read the loss.

``train.on_bad_step``: ``stop`` raises :class:`TrainingDiverged` naming the step; ``skip`` leaves
the weights and optimizer state as they were (the learning-rate schedule and the data advance)
and counts the step. ``train.max_bad_steps`` bad steps in a row ask the loop to roll back to the
newest checkpoint and skip the data that led there (``rollback_due``; TrainLoop.roll_back).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch
import torch.distributed as dist

from parallel3d.base import ConfigError

BAD_STEP_ACTIONS = ("stop", "skip")  # train.on_bad_step
SPIKE_WINDOW = 100  # good steps whose median gradient norm a spike is measured against
SPIKE_MIN_STEPS = 20  # good steps before spikes are judged: the norm falls fast at the start of training


class TrainingDiverged(RuntimeError):
    """A bad step under ``train.on_bad_step=stop``, or bad steps that a rollback cannot cure."""


def check_bad_step_config(train, debug) -> None:
    """ConfigErrors for the train.* bad-step keys and debug.nan_steps (called by validate.check)."""
    if train.on_bad_step not in BAD_STEP_ACTIONS:
        raise ConfigError("train.on_bad_step", train.on_bad_step, "unknown action",
                          f"use one of {', '.join(BAD_STEP_ACTIONS)}")
    if train.spike_factor != 0 and not train.spike_factor > 1:
        raise ConfigError("train.spike_factor", train.spike_factor, "a spike is a multiple of the median grad norm",
                          "use a factor above 1 (e.g. 5), or 0 to turn spike detection off")
    if train.max_bad_steps < 1:
        raise ConfigError("train.max_bad_steps", train.max_bad_steps, "must be >= 1",
                          "use the number of bad steps in a row that trigger a rollback, e.g. 5")
    if any(step < 1 for step in debug.nan_steps):
        raise ConfigError("debug.nan_steps", list(debug.nan_steps), "steps count from 1", "use step numbers >= 1")


class BadStepGuard:
    """Decides, with every other rank, whether this step updates the weights; keeps the counts."""

    def __init__(self, *, on_bad_step: str, spike_factor: float, max_bad_steps: int,
                 nan_steps: list[int] = (), group=None):
        self.on_bad_step, self.spike_factor, self.max_bad_steps = on_bad_step, spike_factor, max_bad_steps
        self.nan_steps, self.group = set(nan_steps), group
        self.recent_norms: deque[float] = deque(maxlen=SPIKE_WINDOW)  # of good steps
        self.skipped_steps = 0  # cumulative over the run, resumes included
        self.bad_in_a_row = 0
        self.rollbacks: list[dict] = []  # {"at_step", "to_step", "skipped_steps", "skipped_samples"}, oldest first
        self.step, self.skipped, self.reason = 0, False, ""  # of the step being decided

    @classmethod
    def for_run(cls, train, debug) -> BadStepGuard:
        return cls(on_bad_step=train.on_bad_step, spike_factor=train.spike_factor,
                   max_bad_steps=train.max_bad_steps, nan_steps=list(debug.nan_steps))

    # -- the decision ---------------------------------------------------------------------

    def begin(self, step: int) -> None:
        self.step, self.skipped, self.reason = step, False, ""

    @property
    def inject_nan(self) -> bool:
        """debug.nan_steps: this step's batch is poisoned. Steps count along the data stream, so a
        rollback that skips the window of a poisoned batch does not meet it again."""
        return self.step + self.data_skipped_steps in self.nan_steps

    @property
    def data_skipped_steps(self) -> int:
        return sum(r["skipped_steps"] for r in self.rollbacks)

    def spike_threshold(self) -> float | None:
        if not self.spike_factor or len(self.recent_norms) < SPIKE_MIN_STEPS:
            return None
        return self.spike_factor * statistics.median(self.recent_norms)

    @torch.no_grad()
    def update_allowed(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Whether this step may update the weights: the same answer on every rank (a collective:
        every rank calls it). ``loss_sum`` is this rank's share, ``grad_norm`` the global norm.
        Raises TrainingDiverged for a bad step under ``on_bad_step=stop``."""
        values = torch.stack([loss_sum.detach().double(), grad_norm.detach().double()])
        ranks = 1
        if self.group is not None or dist.is_initialized():
            # A SUM is non-finite when any rank's loss is; the norm, global already, comes back times
            # the world size and identical on every rank, so every rank judges a spike alike.
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
            ranks = dist.get_world_size(self.group)
        loss_total, norm_total = values.tolist()
        norm, threshold = norm_total / ranks, self.spike_threshold()
        bad_loss = not math.isfinite(loss_total)
        if not bad_loss and math.isfinite(norm) and (threshold is None or norm <= threshold):
            self.recent_norms.append(norm)
            self.bad_in_a_row = 0
            return True
        self.reason = self._describe(bad_loss, norm, threshold)
        if self.on_bad_step == "stop":
            raise TrainingDiverged(f"{self.reason} at step {self.step}: training diverged. Lower optim.lr, raise "
                                   f"optim.warmup_steps or set train.grad_clip; train.on_bad_step=skip skips "
                                   f"such steps")
        self.skipped, self.skipped_steps, self.bad_in_a_row = True, self.skipped_steps + 1, self.bad_in_a_row + 1
        return False

    def _describe(self, bad_loss: bool, norm: float, threshold: float | None) -> str:
        if bad_loss:
            return f"loss is not finite (grad norm {norm:.4g})"
        if not math.isfinite(norm):
            return f"grad norm is {norm}"
        return (f"grad norm {norm:.4g} is over train.spike_factor={self.spike_factor:g} x the median "
                f"{threshold / self.spike_factor:.4g} of the last {len(self.recent_norms)} good steps")

    # -- rollbacks ------------------------------------------------------------------------

    @property
    def rollback_due(self) -> bool:
        return self.bad_in_a_row >= self.max_bad_steps

    def rolled_back(self, *, at_step: int, to_step: int, global_batch_size: int) -> str:
        """Record a rollback from ``at_step`` to checkpoint ``to_step``: the steps after it train on
        the data after ``at_step``. Returns the console line. Raises TrainingDiverged when the
        newest checkpoint is one this run already rolled back to (the bad steps came back)."""
        if any(r["to_step"] == to_step for r in self.rollbacks):
            raise TrainingDiverged(f"{self.max_bad_steps} bad steps in a row up to step {at_step} ({self.reason}), "
                                   f"again after rolling back to step_{to_step}: training diverged. Lower "
                                   f"optim.lr or raise optim.warmup_steps, and resume from an earlier checkpoint")
        skipped = at_step - to_step
        self.rollbacks.append({"at_step": at_step, "to_step": to_step, "skipped_steps": skipped,
                               "skipped_samples": skipped * global_batch_size})
        self.bad_in_a_row = 0
        return (f"parallel3d: {self.max_bad_steps} bad steps in a row up to step {at_step} ({self.reason}): "
                f"rolled back to step_{to_step}; steps {to_step + 1}.. train on the data after step {at_step} "
                f"({skipped} steps of data skipped)")

    def nothing_to_roll_back_to(self, *, at_step: int, every: int) -> TrainingDiverged:
        """The error when train.max_bad_steps bad steps came before any checkpoint of this run:
        its fix says what checkpoint.every would change (it may be set, and only due later)."""
        fix = ("set checkpoint.every to roll back" if not every else
               f"checkpoint.every={every} saves its first checkpoint at step {every}: set it below {at_step} to "
               f"roll back that early")
        return TrainingDiverged(f"{self.max_bad_steps} bad steps in a row up to step {at_step} ({self.reason}) and "
                                f"no checkpoint of this run to roll back to: training diverged. Fix: lower optim.lr "
                                f"or raise optim.warmup_steps, or {fix}")

    # -- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What a checkpoint's meta.json keeps, so that a resumed run judges and counts as this one."""
        return {"skipped_steps": self.skipped_steps, "recent_grad_norms": list(self.recent_norms),
                "rollbacks": list(self.rollbacks)}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = state.get("skipped_steps", 0)
        self.recent_norms = deque(state.get("recent_grad_norms", []), maxlen=SPIKE_WINDOW)
        self.rollbacks = list(state.get("rollbacks", []))
        self.bad_in_a_row = 0


def poison(loss_sum: torch.Tensor, params) -> None:
    """debug.nan_steps: make this rank's loss and gradients NaN, as a bad batch would."""
    nan = float("nan")
    loss_sum.mul_(nan)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(nan)
