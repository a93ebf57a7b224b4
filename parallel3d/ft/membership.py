"""Who took part in a step, and what of the global batch it trained.

Every step the groups of the quorum sum a small roster (one row per replica id: present, newcomer,
healed, config fingerprint) through the managed process group, before any gradient crosses. From
it each group reads the step's participants, refuses a second group with its replica id or a
newcomer whose config differs from the quorum's, and, once the step commits, writes one line to
``run_dir/ft/membership.jsonl``: the participants, the groups that healed, and the slices of the
global batch trained and dropped (the slices of absent groups are dropped, never trained later).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


ROW = 4  # present, newcomer, healed, fingerprint
# The config every group must share: whatever changes the numbers a step computes or the data it reads.
SHARED_TRAIN_KEYS = ("steps", "global_batch_size", "micro_batch_size", "seq_len", "seed", "grad_clip", "param_dtype",
                     "reduce_dtype", "float8", "float8_skip_small", "float8_fsdp_all_gather", "on_bad_step",
                     "spike_factor")


def config_fingerprint(c) -> int:
    """A 31-bit hash of the model, optimizer, data, layout and training keys (and ft.replicas): the
    same on every group that may share a quorum, whatever its replica id, run_dir or timeouts."""
    data = {k: v for k, v in asdict(c.data).items() if k != "cache_dir"}
    shared = {"model": asdict(c.model), "optim": asdict(c.optim), "data": data, "parallel": asdict(c.parallel),
              "train": {k: getattr(c.train, k) for k in SHARED_TRAIN_KEYS},
              "ft": {"replicas": c.ft.replicas, "semi_sync": c.ft.semi_sync, "diloco": asdict(c.ft.diloco)}}
    digest = hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def roster_row(*, replicas: int, replica_id: int, newcomer: bool, healed: bool, fingerprint: int) -> torch.Tensor:
    """This group's contribution to the step's roster (the others' rows zero): summed over the quorum."""
    rows = torch.zeros(replicas, ROW, dtype=torch.int64)
    rows[replica_id] = torch.tensor([1, int(newcomer), int(healed), fingerprint])
    return rows.flatten()


@dataclass
class Roster:
    participants: list[int]  # replica ids of the quorum (each present once)
    healed: list[int]  # ... that healed from a peer at this step
    duplicates: list[int]  # ids two or more groups claim
    mismatched: list[int]  # ids whose config differs from the quorum's
    reference: int | None  # the group whose config is the quorum's

    @classmethod
    def read(cls, summed: torch.Tensor, *, replicas: int) -> Roster:
        rows = summed.view(replicas, ROW).tolist()
        single = [r for r in range(replicas) if rows[r][0] == 1]
        # The quorum's config: its longest-standing group's (newcomers join it, not the other way round).
        standing = [r for r in single if rows[r][1] == 0] or single
        reference = standing[0] if standing else None
        return cls(participants=[r for r in range(replicas) if rows[r][0] >= 1],
                   healed=[r for r in single if rows[r][2]],
                   duplicates=[r for r in range(replicas) if rows[r][0] > 1],
                   mismatched=[r for r in single if rows[r][3] != rows[reference][3]],
                   reference=reference)

    def refusal(self, *, replica_id: int, newcomer: bool) -> str | None:
        """The one line a newcomer stops with, or None when it may stay. A group already training
        stays; the step with a refused group in it is discarded all the same (see ``clean``)."""
        if replica_id in self.duplicates and newcomer:
            return (f"ft.replica_id={replica_id}: another live replica group has this id, so both would train one "
                    f"slice of the batch. Fix: give each group its own ft.replica_id, 0..ft.replicas-1")
        if replica_id in self.mismatched and newcomer:
            return (f"ft: this replica group's config differs from the quorum's (replica group {self.reference}): "
                    f"model, optimizer, data, global batch or layout. Fix: start it with the quorum's config, "
                    f"changing only ft.replica_id")
        return None

    @property
    def clean(self) -> bool:
        return not self.duplicates and not self.mismatched


class MembershipLog:
    """run_dir/ft/membership.jsonl, written by the group's rank 0: one line per committed step. A step
    trained again after every group restarted from an older checkpoint gets a new line: the latest
    line of a step counts."""

    def __init__(self, run_dir: Path, *, replicas: int, global_batch_size: int, enabled: bool):
        self.path = run_dir / "ft" / "membership.jsonl"
        self.replicas, self.slice_rows, self.enabled = replicas, global_batch_size // replicas, enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def entry(self, step: int, roster: Roster, replica_id: int, *, discarded: int = 0,
              joined_after_s: float | None = None, trained: bool = True,
              state_digests: list[str] | None = None) -> dict:
        """``discarded``: earlier attempts at this step that some group failed; ``joined_after_s``: on
        this group's first committed step since it started, the seconds from the end of its start-up
        (model built, data ready) to this commit: the quorum, the heal and one step. ``trained``
        false: a DiLoCo period whose sync failed, every slice dropped. ``state_digests``: at a step a
        group healed, each rank's digest of its whole state before the update (every group's equal)."""
        kept = roster.participants if trained else []
        dropped = [r for r in range(self.replicas) if r not in kept]
        return {"step": step, "time": round(time.time(), 3), "replica_id": replica_id, "joined_after_s": joined_after_s,
                "discarded_attempts": discarded, "participants": roster.participants,
                "healed": roster.healed, "trained_slices": kept, "dropped_slices": dropped,
                "slice_rows": self.slice_rows, "samples_trained": len(kept) * self.slice_rows,
                "samples_dropped": len(dropped) * self.slice_rows,
                **({"state_digests": state_digests} if state_digests is not None else {})}

    def write(self, step: int, roster: Roster, replica_id: int, **details) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(self.entry(step, roster, replica_id, **details)) + "\n")


def read_membership(paths: list[Path]) -> dict[int, dict]:
    """Step -> the entry of the commit the run's final weights descend from, from the membership
    logs of all its groups. Walked back from the last step: a step's state came from the previous
    step's commit of a participant that did not heal (its own latest line of that step written
    before), so lines a restart from an older checkpoint undid, or a group that trained alone
    before healing from a peer, drop out. Raises ValueError when a step has no such line."""
    lines = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    if not lines:
        return {}
    current = max(lines, key=lambda e: (e["step"], e["time"]))
    chain = {current["step"]: current}
    for step in range(current["step"] - 1, 0, -1):
        carried = set(current["participants"]) - set(current["healed"])
        earlier = [e for e in lines
                   if e["step"] == step and e["replica_id"] in carried and e["time"] <= current["time"]]
        if not earlier:
            raise ValueError(f"no group of step {step + 1}'s quorum {sorted(carried)} logged step {step}: "
                             f"pass the membership.jsonl of every group")
        current = chain[step] = max(earlier, key=lambda e: e["time"])
    return dict(sorted(chain.items()))
