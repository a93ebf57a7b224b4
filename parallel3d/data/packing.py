"""Which samples share a row: best-fit decreasing over a bounded window, a pure function of the lengths.

Samples are taken WINDOW at a time in file order; within a window, longest first (ties: file
order), each goes into the open row with the least room that still holds it (best fit), or starts
a row. Rows stay open across windows, so a window's short samples fill the gaps the earlier ones
left; at most MAX_OPEN rows are open, and when one more would be, the fullest is closed (it keeps
what it has). Greedy packing in file order closes a row at the first sample that does not fit;
best fit over a window of a thousand samples fills rows to within a few percent of full on varied
lengths (BENCHMARKS.md (k)).

The result depends on the lengths alone, in their order, never on who computes it: a shard's
rows are the same for every layout, rank count and resume (tokenization writes them once, and the
sampler draws rows by (seed, step)). The window and the row bound are part of the rows cache key
(``PACKER``): a change rebuilds the cached rows.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

WINDOW = 1024  # samples sorted together: a larger window packs a little tighter and holds more in memory
MAX_OPEN = 256  # rows that may still take a sample: bounds the search per sample
PACKER = f"best-fit-decreasing/{WINDOW}/{MAX_OPEN}"


def best_fit_rows(*, lengths: Sequence[int], width: int, window: int = WINDOW, max_open: int = MAX_OPEN
                  ) -> list[list[int]]:
    """The samples (indices into ``lengths``) of each row of ``width`` tokens, rows in the order
    they were started, each row's samples in the order they were placed. Every length must be
    between 1 and ``width``."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row) of the open rows, least room first
    for first in range(0, len(lengths), window):
        for i in sorted(range(first, min(first + window, len(lengths))), key=lambda i: (-lengths[i], i)):
            at = bisect_left(room, (lengths[i], -1))
            if at < len(room):
                left, row = room.pop(at)
                rows[row].append(i)
            else:
                left, row = width, len(rows)
                rows.append([i])
            if left - lengths[i] > 0:
                insort(room, (left - lengths[i], row))
                if len(room) > max_open:
                    room.pop(0)  # the fullest open row is closed
    return rows
