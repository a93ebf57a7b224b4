"""Pipeline schedules: the bubble, and how many microbatches' activations a rank holds at once.

Bubble fractions (idle share of a pipeline rank's step; p ranks, m microbatches per schedule
step, v stages per rank; forward : backward = 1 : 2, zero-bubble schedules split the backward
into input and weight gradients of one forward each):

    GPipe, 1F1B          (p-1) / (m + p-1)        Huang et al. 2019 (GPipe); Narayanan et al. 2021 §2.2
    Interleaved1F1B      (p-1) / (v·m + p-1)      Narayanan et al. 2021 §2.2.2: the fill shrinks v-fold
    zero bubble          (p-1) / (3·v·m + p-1)    Qi et al. 2023 (ZB-H1): bubble (p-1)(T_F + T_B - T_W),
                                                  one chunk's forward per rank when T_F = T_B = T_W
    ZBVZeroBubble        as zero bubble once m >= (3p-1)/2; with fewer, torch's V order idles
                         4p-2m-2 forward units instead of p-1 (fitted to torch 2.13's order)

tests/test_planner.py checks each against a timeline of torch's own action order.

Activations in flight come from that order itself (``torch.distributed.pipelining``'s schedule
IR): a stage's forward of a microbatch adds its activations, its backward (or, split, its weight
gradient) frees them, and the rank's peak is the largest sum along its order. The closed forms
(1F1B: p - r microbatches on rank r; interleaved: ``(v-1)·m/rounds + 2(p-1-r) + 1`` chunks, with
rounds = m // p) are what this reproduces.
"""

from __future__ import annotations

from functools import lru_cache

from parallel3d.planner.layout import Layout

ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline step (0 without pipelining)."""
    if p == 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    idle = p - 1  # in forward-chunk units; a chunk's forward + input grad + weight grad = 3 units
    if schedule == "ZBVZeroBubble":
        idle = max(idle, 4 * p - 2 * m - 2)
    return idle / (3 * v * m + idle)


def _simulated_microbatches(schedule: str, p: int, m: int) -> int:
    """Microbatches to replay: the in-flight peak is reached within the first rounds, so long
    steps are replayed shortened, keeping what sets the peak (looped schedules: the round size)."""
    if schedule == "GPipe" or m <= 2 * p:
        return m
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        return 2 * (m // (m // p))  # two rounds of the same size
    return 2 * p


@lru_cache(maxsize=256)
def _actions(schedule: str, p: int, m: int, v: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Each pp rank's compute actions in torch's order, as (F/B/I/W, stage)."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    out = []
    for rank_ops in get_schedule_ops(schedule, p, m, num_stages_per_rank=v):
        actions = []
        for op in rank_ops:
            for sub in ((op.sub_actions or [op]) if op is not None else []):  # DualPipeV overlaps F with B
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    actions.append((kind, sub.stage_index))
        out.append(tuple(actions))
    return tuple(out)


def peak_in_flight(layout: Layout, stage_bytes: dict[int, int], pp_rank: int,
                   unsharded_grads: dict[int, int] | None = None, sharded_grads: dict[int, int] | None = None) -> int:
    """Largest sum of activation bytes ``pp_rank`` holds at once over one schedule step, given
    each of its stages' bytes per microbatch. Without pipelining: one micro batch.

    With FSDP (``unsharded_grads``), a stage's unsharded gradients accumulate from its first
    weight-gradient computation to its last, which reduce-scatters them into its sharded ones
    (``sharded_grads``, from then on): with few microbatches the activations peak in the warm-up,
    before any gradient exists, and looped schedules finish one stage's backwards before the
    next one's start."""
    if layout.pp == 1:
        return max(stage_bytes.values())
    m = _simulated_microbatches(layout.pp_schedule, layout.pp, layout.schedule_microbatches)
    unsharded, sharded = unsharded_grads or {}, sharded_grads or {}
    held = peak = 0
    backwards: dict[int, int] = {}
    for kind, stage in _actions(layout.pp_schedule, layout.pp, m, layout.stages_per_rank)[pp_rank]:
        if kind == "F":
            held += stage_bytes[stage]
        elif kind in ("B", "W"):  # a split backward frees the activations with the weight gradients
            backwards[stage] = backwards.get(stage, 0) + 1
            if backwards[stage] == 1:
                held += unsharded.get(stage, 0)
            peak = max(peak, held)  # while this microbatch's activations are still alive
            held -= stage_bytes[stage]
            if backwards[stage] == m:
                held += sharded.get(stage, 0) - unsharded.get(stage, 0)
        peak = max(peak, held)
    return peak


def in_flight_microbatches(layout: Layout, pp_rank: int) -> dict[int, int]:
    """Microbatches each of ``pp_rank``'s stages holds at the rank's peak (unit stage sizes)."""
    if layout.pp == 1:
        return {0: 1}
    m = _simulated_microbatches(layout.pp_schedule, layout.pp, layout.schedule_microbatches)
    held: dict[int, int] = {}
    best: dict[int, int] = {}
    for kind, stage in _actions(layout.pp_schedule, layout.pp, m, layout.stages_per_rank)[pp_rank]:
        held[stage] = held.get(stage, 0) + (1 if kind == "F" else -1 if kind in ("B", "W") else 0)
        if sum(held.values()) > sum(best.values()):
            best = dict(held)
    return best
