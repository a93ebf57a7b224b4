"""Prepare the next step's micro batches in a background thread while the current step runs.

Reading windows from memory-mapped token files and stacking them is numpy work that releases
the GIL for the copies; one step ahead is enough to hide it behind a training step. The loop
asks for step s and gets its batches plus how long it waited for them (``data_wait_s``).
A plain thread rather than torch's DataLoader: the batches are a pure function of the step, so
there is no dataset to iterate, no worker processes to fork beside torchrun's, and the order
cannot depend on timing.
"""

from __future__ import annotations

import queue
import threading
import time


class Prefetcher:
    """Yields ``sampler.micro_batches(step)`` for steps first..last, one step ahead."""

    def __init__(self, sampler, first: int, last: int, depth: int = 1):
        self.sampler, self.next_step = sampler, first
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(first, last), daemon=True,
                                        name="parallel3d-prefetch")
        self._thread.start()

    def _fill(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            try:
                item = (step, self.sampler.micro_batches(step), None)
            except BaseException as e:  # handed to the loop, raised there
                item = (step, None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[2] is not None:
                return

    def get(self, step: int):
        """(the micro batches of ``step``, seconds spent waiting for them)."""
        if step != self.next_step:
            raise ValueError(f"batches are prepared in order: asked for step {step}, next is {self.next_step}")
        start = time.perf_counter()
        got, batches, error = self._queue.get()
        waited = time.perf_counter() - start
        if error is not None:
            raise error
        assert got == step
        self.next_step += 1
        return batches, waited

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
