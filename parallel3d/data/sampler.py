"""Which sequences a step trains on: a pure function of (seed, step), whatever the layout.

The token stream is cut into windows of seq_len input tokens; a window's targets are the same
tokens shifted by one, so consecutive windows share one boundary token. Each epoch visits the windows in a fresh seeded permutation. The global batch
of step s is the next global_batch_size windows of that stream; data-parallel rank r takes the
r-th contiguous slice of it, in micro batches. Tensor and pipeline ranks of one data-parallel
group get the same slice. Resuming needs nothing but the position in the stream: the step, or,
when the global batch size changed, the number of sequences already trained on (``offset``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parallel3d.data.sft import row_fill, row_micro_batches, trained_targets


@dataclass(frozen=True)
class BatchSpec:
    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.dp_size

    @property
    def num_micro_batches(self) -> int:
        return self.local_batch_size // self.micro_batch_size


class StepSampler:
    def __init__(self, tokens: np.ndarray, spec: BatchSpec, seed: int, offset: int = 0, name: str = "corpus",
                 flags: np.ndarray | None = None, packed: bool = True):
        """``offset``: windows of the stream before step 1's batch (a resumed run's data position);
        ``name``: the corpus's name in the metrics (``tokens/<name>``). ``flags``: instruction data
        (parallel3d/data/sft.py): the tokens are rows of seq_len + 1, each a window of its own, and
        the flags say which targets are trained and, for ``packed`` rows, where samples start."""
        self.tokens, self.spec, self.seed, self.offset, self.name = tokens, spec, seed, offset, name
        self.flags, self.packed = flags, packed
        self.stride = spec.seq_len if flags is None else spec.seq_len + 1
        self.num_windows = (len(tokens) - 1) // spec.seq_len if flags is None else len(tokens) // self.stride
        if self.num_windows < spec.global_batch_size:
            raise ValueError(f"the corpus holds {self.num_windows} sequences of {spec.seq_len + 1} tokens, "
                             f"fewer than one global batch ({spec.global_batch_size}): use more data")
        # (epoch, its permutation), swapped as one: the prefetch thread and the loop (trained_tokens) both read it
        self._order: tuple[int, torch.Tensor] | None = None

    def window_ids(self, step: int) -> list[int]:
        """Global window indices of this rank's slice of the batch of ``step`` (1-based)."""
        spec = self.spec
        first = self.samples_seen(step - 1) + spec.dp_rank * spec.local_batch_size
        return [self._window(pos) for pos in range(first, first + spec.local_batch_size)]

    def trained_tokens(self, step: int) -> int | None:
        """Trained targets of the whole global batch of ``step`` (every rank gets the same count,
        without communicating); None for plain text, where every target is trained."""
        if self.flags is None:
            return None
        first = self.samples_seen(step - 1)
        windows = [self._window(p) for p in range(first, first + self.spec.global_batch_size)]
        return trained_targets(self._rows(self.flags, windows))

    def batch_fill(self, step: int) -> dict[str, float]:
        """Instruction rows: ``row_fill``, the sample share of the global batch's row tokens of
        ``step`` (the same on every rank); {} for plain text, which has no padding."""
        if self.flags is None:
            return {}
        first = self.samples_seen(step - 1)
        windows = [self._window(p) for p in range(first, first + self.spec.global_batch_size)]
        return {"row_fill": row_fill(self._rows(self.flags, windows))}

    def samples_seen(self, step: int) -> int:
        """Sequences of the stream consumed once ``step`` is done: the data position to save."""
        return self.offset + step * self.spec.global_batch_size

    def tokens_consumed(self, step: int) -> dict[str, int]:
        """Input tokens trained on once ``step`` is done (cumulative), as MixtureSampler reports them."""
        return {f"tokens/{self.name}": self.samples_seen(step) * self.spec.seq_len}

    def _window(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_windows)
        cached = self._order
        if cached is None or cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            cached = (epoch, torch.randperm(self.num_windows, generator=generator))
            self._order = cached
        return int(cached[1][offset])

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """(inputs, targets) pairs, each (micro_batch_size, seq_len) int64, for ``step``; packed
        instruction rows add each input token's sample (data/sft.py ``row_micro_batches``)."""
        windows = self.window_ids(step)
        rows = self._rows(self.tokens, windows)
        if self.flags is not None:
            return row_micro_batches(rows, self._rows(self.flags, windows), self.spec.micro_batch_size, self.packed)
        batch = torch.from_numpy(rows.astype(np.int64))
        return [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(self.spec.micro_batch_size)]

    def _rows(self, array: np.ndarray, windows: list[int]) -> np.ndarray:
        L, stride = self.spec.seq_len, self.stride
        return np.stack([array[w * stride : w * stride + L + 1] for w in windows])
