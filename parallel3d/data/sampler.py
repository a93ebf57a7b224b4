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
    def __init__(self, tokens: np.ndarray, spec: BatchSpec, seed: int, offset: int = 0, name: str = "corpus"):
        """``offset``: windows of the stream before step 1's batch (a resumed run's data position);
        ``name``: the corpus's name in the metrics (``tokens/<name>``)."""
        self.tokens, self.spec, self.seed, self.offset, self.name = tokens, spec, seed, offset, name
        self.num_windows = (len(tokens) - 1) // spec.seq_len
        if self.num_windows < spec.global_batch_size:
            raise ValueError(f"the corpus holds {self.num_windows} sequences of {spec.seq_len + 1} tokens, "
                             f"fewer than one global batch ({spec.global_batch_size}): use more data")
        self._epoch, self._order = -1, None

    def window_ids(self, step: int) -> list[int]:
        """Global window indices of this rank's slice of the batch of ``step`` (1-based)."""
        spec = self.spec
        first = self.samples_seen(step - 1) + spec.dp_rank * spec.local_batch_size
        return [self._window(pos) for pos in range(first, first + spec.local_batch_size)]

    def samples_seen(self, step: int) -> int:
        """Sequences of the stream consumed once ``step`` is done: the data position to save."""
        return self.offset + step * self.spec.global_batch_size

    def tokens_consumed(self, step: int) -> dict[str, int]:
        """Input tokens trained on once ``step`` is done (cumulative), as MixtureSampler reports them."""
        return {f"tokens/{self.name}": self.samples_seen(step) * self.spec.seq_len}

    def _window(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_windows)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.num_windows, generator=generator)
        return int(self._order[offset])

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets) pairs, each (micro_batch_size, seq_len) int64, for ``step``."""
        L = self.spec.seq_len
        rows = np.stack([self.tokens[w * L : w * L + L + 1] for w in self.window_ids(step)]).astype(np.int64)
        batch = torch.from_numpy(rows)
        return [(mb[:, :-1], mb[:, 1:]) for mb in batch.split(self.spec.micro_batch_size)]
