"""Which source and which window each sample comes from: a pure function of (seed, position).

The sample stream is cut into blocks of BLOCK positions; block b draws each position's source
from the mixture weights with a generator seeded by (seed, b). A sample's window is the next
unseen one of its source: the k-th sample drawn from source s takes window k of s's stream,
which visits s's windows in a fresh seeded permutation each epoch (as StepSampler does for one
token file). Everything, including the tokens consumed per source, follows from the position
alone, so a run resumed at another layout, data-parallel degree or global batch size reads on
from exactly where the checkpoint's ``samples_seen`` says. Windows never straddle two token
files of a source.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from parallel3d.data.sampler import BatchSpec
from parallel3d.data.sft import row_fill, row_micro_batches, trained_targets

BLOCK = 4096


@dataclass
class SourceTokens:
    """One source's tokens: its shards' token arrays, in order."""

    name: str
    arrays: list[np.ndarray]
    flags: list[np.ndarray] | None = None  # instruction data: each array is rows, with these flags (data/sft.py)

    @property
    def num_tokens(self) -> int:
        return sum(len(a) for a in self.arrays)


class MixtureSampler:
    """StepSampler's contract (``micro_batches``, ``samples_seen``, ``offset``) over weighted sources."""

    def __init__(self, sources: list[SourceTokens], spec: BatchSpec, seed: int, offset: int = 0,
                 weights: list[float] | None = None, packed: bool = True):
        self.sources, self.spec, self.seed, self.offset, self.packed = sources, spec, seed, offset, packed
        L = spec.seq_len
        self.rows = sources[0].flags is not None  # rows of L + 1 tokens, each a window of its own
        self.stride = L + 1 if self.rows else L
        self._bounds = [np.cumsum([0] + [(len(a) if self.rows else max(len(a) - 1, 0)) // self.stride
                                         for a in s.arrays]) for s in sources]
        self.num_windows = [int(b[-1]) for b in self._bounds]
        for s, n in zip(sources, self.num_windows):
            if n == 0:
                raise ValueError(f"source {s.name} holds no sequence of {L + 1} tokens: use more data or a "
                                 "shorter train.seq_len")
        if sum(self.num_windows) < spec.global_batch_size:
            raise ValueError(f"the corpus holds {sum(self.num_windows)} sequences of {L + 1} tokens, "
                             f"fewer than one global batch ({spec.global_batch_size}): use more data")
        weights = weights or [s.num_tokens for s in sources]  # default: proportional to tokens
        self.weights = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        self._lock = threading.Lock()  # the prefetch thread samples while the loop reads counts
        self._counts = [np.zeros(len(sources), np.int64)]  # samples per source before block b
        self._block_cache: tuple[int, np.ndarray] | None = None
        self._orders: dict[int, tuple[int, torch.Tensor]] = {}  # source -> (epoch, permutation)

    def samples_seen(self, step: int) -> int:
        """Sequences of the stream consumed once ``step`` is done: the data position to save."""
        return self.offset + step * self.spec.global_batch_size

    def tokens_consumed(self, step: int) -> dict[str, int]:
        """Tokens trained on per source once ``step`` is done (cumulative, input tokens)."""
        counts = self._counts_before(self.samples_seen(step))
        return {f"tokens/{s.name}": int(c) * self.spec.seq_len for s, c in zip(self.sources, counts)}

    def window_ids(self, step: int) -> list[tuple[int, int]]:
        """(source, window of that source) for this rank's slice of the batch of ``step`` (1-based)."""
        spec = self.spec
        return self._ids(self.samples_seen(step - 1) + spec.dp_rank * spec.local_batch_size, spec.local_batch_size)

    def trained_tokens(self, step: int) -> int | None:
        """Trained targets of the whole global batch of ``step``, the same on every rank; None for text."""
        if not self.rows:
            return None
        ids = self._ids(self.samples_seen(step - 1), self.spec.global_batch_size)
        return trained_targets(np.stack([self._row(s, w, flags=True) for s, w in ids]))

    def batch_fill(self, step: int) -> dict[str, float]:
        """Instruction rows: ``row_fill``, the sample share of the global batch's row tokens of
        ``step`` (the same on every rank); {} for plain text."""
        if not self.rows:
            return {}
        ids = self._ids(self.samples_seen(step - 1), self.spec.global_batch_size)
        return {"row_fill": row_fill(np.stack([self._row(s, w, flags=True) for s, w in ids]))}

    def _ids(self, first: int, count: int) -> list[tuple[int, int]]:
        with self._lock:
            counts = self._counts_before_locked(first).copy()
            ids = []
            for position in range(first, first + count):
                source = int(self._block(position // BLOCK)[position % BLOCK])
                ids.append((source, self._window(source, int(counts[source]))))
                counts[source] += 1
        return ids

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """(inputs, targets) pairs, each (micro_batch_size, seq_len) int64, for ``step``, as
        StepSampler's (with sample ids for packed instruction rows)."""
        ids = self.window_ids(step)
        rows = np.stack([self._row(s, w) for s, w in ids])
        if self.rows:
            flags = np.stack([self._row(s, w, flags=True) for s, w in ids])
            return row_micro_batches(rows, flags, self.spec.micro_batch_size, self.packed)
        batch = torch.from_numpy(rows.astype(np.int64))
        return [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(self.spec.micro_batch_size)]

    def _row(self, source: int, window: int, flags: bool = False) -> np.ndarray:
        bounds, L = self._bounds[source], self.spec.seq_len
        shard = int(np.searchsorted(bounds, window, side="right")) - 1
        start = (window - int(bounds[shard])) * self.stride
        arrays = self.sources[source].flags if flags else self.sources[source].arrays
        return arrays[shard][start : start + L + 1]

    def _counts_before(self, position: int) -> np.ndarray:
        with self._lock:
            return self._counts_before_locked(position)

    def _counts_before_locked(self, position: int) -> np.ndarray:
        block, within = divmod(position, BLOCK)
        while len(self._counts) <= block:  # once per block ever reached: resuming far is cheap enough
            b = len(self._counts) - 1
            self._counts.append(self._counts[b] + np.bincount(self._block(b), minlength=len(self.sources)))
        return self._counts[block] + np.bincount(self._block(block)[:within], minlength=len(self.sources))

    def _block(self, block: int) -> np.ndarray:
        if self._block_cache is None or self._block_cache[0] != block:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + block)
            draws = torch.multinomial(self.weights, BLOCK, replacement=True, generator=generator)
            self._block_cache = (block, draws.numpy())
        return self._block_cache[1]

    def _window(self, source: int, k: int) -> int:
        epoch, offset = divmod(k, self.num_windows[source])
        cached = self._orders.get(source)
        if cached is None or cached[0] != epoch:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 8191 + source)
            cached = (epoch, torch.randperm(self.num_windows[source], generator=generator))
            self._orders[source] = cached
        return int(cached[1][offset])
