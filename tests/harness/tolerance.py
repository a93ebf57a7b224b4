"""Parity tolerances derived from the one-process run's own sensitivity, not fitted to a machine.

A layout computes what one process computes in another float32 order: tensor parallelism splits a
matmul's sum, data parallelism sums gradients over ranks, a CPU with other kernels (torch's
``ATEN_CPU_CAPABILITY``) blocks its sums otherwise. Each reorder moves a value by float32 round-off,
and training carries that through the steps by as much as the run itself amplifies it: AdamW's
tiny model keeps its losses within a few float32 spacings over the parity runs' steps, Muon (Newton–Schulz) and
bf16 (a master weight's update flips its bf16 copy) move far more. A bound chosen from the numbers
one machine printed is a coin toss on the next.

So each family of parity runs trains its one-process reference with its DRAWS twins, in one
launch: the same run with ``debug.grad_noise=grad_noise()``, every gradient perturbed by Gaussian
noise of the size by which two float32 evaluations of a weight gradient's sum differ on this
machine, relative to its tensor's root mean square, one draw of the noise each. The spread between
the reference and a twin, per metric over the logged steps and over the final weights, is how far
round-off carries in this run on this machine; the larger of the twins' spreads counts. A layout
is held to

    tolerance = MARGIN x max(spread, FLOAT32_EPS)

MARGIN covers what the noise leaves out: a layout also reorders the forward (tensor parallelism
splits the matmuls whose outputs every later layer reads), and a draw's spread varies from the
next draw's. FLOAT32_EPS is the floor: a float32 value resolves no relative
difference below its own spacing, so a metric the noise leaves unmoved (the first step's loss)
still gets MARGIN float32 spacings. ``tools/parity_sensitivity.py`` measures the twins' spreads
beside those of the same run under other kernel sets, and tabulates how close the layouts of a
test run came to their tolerances (``P3D_PARITY_LOG``); docs/parallelism.md, "How close is close",
has the figures.

Where the spread is large the families choose a setting that keeps it small instead of accepting a
loose bound (Muon and bf16 at a lower lr): a tolerance is useful only far below the difference a
real fault makes (a missing gradient average, a wrong shard).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field

MARGIN = 10.0
FLOAT32_EPS = 2.0**-23  # the spacing of float32 numbers in [1, 2), relative
# One pass from the same weights (a first step's loss and grad norm, a checkpoint evaluated again at
# another layout): no training carries the round-off along, so the floor alone bounds it.
ONE_PASS = MARGIN * FLOAT32_EPS
DRAWS = 2  # twins per reference, each another draw of the noise: the larger spread rarely falls low
# A perturbed run writes no checkpoint (parallel3d refuses it): the twin drops the reference's
# checkpoint keys, which change nothing it computes.
_NOT_IN_TWIN = ("checkpoint.every=", "checkpoint.keep_last=")


@functools.cache
def grad_noise() -> float:
    """The twin's noise, relative to each gradient tensor's root mean square: sqrt(2) times the
    relative root-mean-square error of a float32 matmul against float64 on this machine's kernels,
    at the tiny models' weight-gradient shape (a sum over the 1024 tokens of a micro batch of 16).
    That is how far two float32 evaluations of such a sum in other orders lie apart, which is how
    far a layout's gradient lies from one process's. (2 significant digits: an override's text.)"""
    import torch

    generator = torch.Generator().manual_seed(0)
    inputs, grads = torch.randn(128, 1024, generator=generator), torch.randn(1024, 384, generator=generator)
    exact = inputs.double() @ grads.double()
    error = ((inputs @ grads).double() - exact).square().mean().sqrt() / exact.square().mean().sqrt()
    return float(f"{math.sqrt(2) * error.item():.2g}")


def twin_overrides(overrides: list[str], draw: int = 0) -> list[str]:
    """The reference's overrides with its gradients perturbed by ``grad_noise()`` (``debug.grad_noise``),
    noise draw ``draw``."""
    kept = [o for o in overrides if not o.startswith(_NOT_IN_TWIN)]
    return [*kept, f"debug.grad_noise={grad_noise()}", f"debug.grad_noise_draw={draw}"]


def twins(name: str, overrides: list[str]) -> dict[str, list[str]]:
    """The twins of the reference ``name`` (run name: overrides), DRAWS of them."""
    return {f"{name}-noise{draw}": twin_overrides(overrides, draw) for draw in range(DRAWS)}


def metric_spread(reference_rows: list[dict], rows: list[dict], key: str) -> float:
    """The largest relative difference of ``key`` over the steps both logged it (a step both logged
    as NaN, one the bad-step guard skipped in both, is no difference; NaN in one of them is infinite)."""
    want = {r["step"]: r[key] for r in reference_rows if key in r}
    got = {r["step"]: r[key] for r in rows if key in r}
    steps = [s for s in sorted(want.keys() & got.keys()) if not (math.isnan(want[s]) and math.isnan(got[s]))]
    assert steps, f"no step logs {key} in both runs"
    errors = [0.0 if got[s] == want[s] else abs(got[s] - want[s]) / abs(want[s]) for s in steps]  # 0 == 0: none
    return math.inf if any(math.isnan(e) for e in errors) else max(errors)


def weight_spread(reference: dict, weights: dict) -> float:
    """The smallest t with every |a - b| <= t + t |b| (torch.testing.assert_close's test at rtol=atol=t)."""
    assert reference.keys() == weights.keys(), sorted(reference.keys() ^ weights.keys())
    return max(((weights[k].double() - reference[k].double()).abs() / (1 + reference[k].double().abs())).max().item()
               for k in reference)


@dataclass(frozen=True)
class Tolerance:
    """Tolerances per metric (and ``weights``): MARGIN x the measured spread, floored at FLOAT32_EPS."""

    spreads: dict[str, float]
    source: str  # what was measured, for the failure message
    margin: float = MARGIN
    floors: dict[str, float] = field(default_factory=dict)  # per key, where not FLOAT32_EPS

    def __getitem__(self, key: str) -> float:
        return self.margin * max(self.spreads[key], self.floors.get(key, FLOAT32_EPS))

    def explain(self, key: str) -> str:
        return (f"tolerance {self[key]:.3g} = {self.margin:g} x max(spread {self.spreads[key]:.3g}, floor "
                f"{self.floors.get(key, FLOAT32_EPS):.3g}) of {self.source}")

    def widened(self, other: Tolerance) -> Tolerance:
        """The larger spread of the two, per key both measured."""
        keys = self.spreads.keys() & other.spreads.keys()
        return Tolerance({k: max(self.spreads[k], other.spreads[k]) for k in keys},
                         f"{self.source} and {other.source}", self.margin, self.floors)


def measure(reference, *others, metrics: tuple[str, ...] = ("loss", "grad_norm", "val_loss", "aux_loss"),
            weights: bool = True, source: str = "") -> Tolerance:
    """The Tolerance that the spread between ``reference`` and each of ``others`` (Runs: its twin,
    or the same run in another order) implies: the largest over ``others``, per metric they log
    and, with ``weights``, over the final weights."""
    from harness.runs import final_weights  # (runs.py imports this module)

    spreads = {}
    for key in metrics:
        if any(key in row for row in reference.metrics):
            spreads[key] = max(metric_spread(reference.metrics, other.metrics, key) for other in others)
    if weights:
        want = final_weights(reference.run_dir)
        spreads["weights"] = max(weight_spread(want, final_weights(other.run_dir)) for other in others)
    assert any(spreads.values()), f"{[o.run_dir.name for o in others]} trained exactly as {reference.run_dir.name}"
    names = ", ".join(other.run_dir.name for other in others)
    return Tolerance(spreads, source or f"{reference.run_dir.name} against {names}")


def log_comparison(reference, run, errors: dict[str, float], tolerance: Tolerance | float) -> None:
    """``P3D_PARITY_LOG=FILE``: append a comparison of ``run`` with ``reference`` (Runs: their errors,
    tolerances and the reference's spreads) as a JSON line; ``tools/parity_sensitivity.py
    summarize FILE`` tabulates the margins."""
    log = os.environ.get("P3D_PARITY_LOG")
    if not log:
        return
    import torch

    row = {"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
           "capability": torch.backends.cpu.get_cpu_capability(),
           "reference": reference.run_dir.name, "run": run.run_dir.name, "errors": errors,
           "tolerances": {k: tolerance[k] if isinstance(tolerance, Tolerance) else tolerance for k in errors},
           "spreads": {k: tolerance.spreads[k] for k in errors} if isinstance(tolerance, Tolerance) else None}
    with open(log, "a") as f:
        f.write(json.dumps(row) + "\n")
