"""A live progress display for long work on rank 0: training steps, checkpoint saves, data preparation.

On a terminal (stderr is a TTY) a bar shows the training steps (step/total, rate, ETA, the last
logged loss) with a checkpoint save in progress in its description; data preparation gets a
counting bar. Lines (the per-step metrics, "saved checkpoint", "tokenized ...") go to stdout in
every case, above the bar, so a log file or a SLURM output reads the same with or without a
terminal and never holds '\\r' redraws. ``TQDM_DISABLE=1`` turns the bars off on a terminal too
(tqdm reads its TQDM_* variables for every bar), leaving just the lines.

tqdm rather than rich: one small pure-Python dependency that draws on a plain stream, leaves
stdout alone and writes lines above its bars (``external_write_mode``); rich's Live display
takes over the console, which we neither need nor want under torchrun's shared terminal.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from tqdm import tqdm

from parallel3d.base import rank

STEPS = "train"


class Progress:
    """Bars on a terminal, plain lines elsewhere; a no-op on ranks other than 0.

    ``file`` (default stderr) gets the bars, and only when it is a terminal; ``out`` (default
    stdout) gets the lines. Both default to the streams of the moment, not of import time,
    so tests and pytest's capture can swap them.
    """

    def __init__(self, enabled: bool | None = None, file: TextIO | None = None, out: TextIO | None = None):
        if enabled is None:  # torchrun sets RANK; a lone process is rank 0
            enabled = rank() == 0
        self.enabled = enabled
        self.file = file if file is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        self.live = enabled and _isatty(self.file)
        self._bar: tqdm | None = None
        self._saving: tuple[str, float] | None = None  # (checkpoint name, start time) of a save in flight

    # -- training steps -------------------------------------------------------------------

    def start(self, total: int, done: int = 0) -> None:
        """The step bar; ``done`` steps already (a resumed run), so the rate and ETA count this run's."""
        if self.live:
            self._bar = tqdm(total=total, initial=done, desc=STEPS, unit="step", file=self.file,
                             dynamic_ncols=True)

    def update(self, step: int) -> None:
        """``step`` steps done (called every step: cheap, tqdm redraws at most every 0.1 s)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def write(self, line: str, loss: float | None = None) -> None:
        """Print a line above the bar (plainly without one); ``loss`` goes into the bar's postfix."""
        if not self.enabled:
            return
        if self._bar is not None and loss is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        # Clears the bar (on the terminal that ``out`` shares: stdout and stderr always count as
        # shared) and redraws it, new postfix included, after the line.
        with tqdm.external_write_mode(file=self.out):
            print(line, file=self.out, flush=True)  # flush: a piped stdout must not hold lines back

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- checkpoints ----------------------------------------------------------------------

    def saving(self, name: str) -> None:
        """A checkpoint save started; with async saves it finishes steps later (see ``saved``)."""
        if self.enabled:
            self._saving = (name, time.perf_counter())
            self._describe(f"{STEPS} (saving {name})")

    def saved(self, name: str) -> None:
        if not self.enabled:
            return
        start = self._saving[1] if self._saving and self._saving[0] == name else time.perf_counter()
        self._saving = None
        self._describe(STEPS)
        self.write(f"parallel3d: saved checkpoint {name} ({time.perf_counter() - start:.1f} s)")

    def _describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text)  # redraws now: a save is worth showing at once

    # -- data preparation -----------------------------------------------------------------

    @contextlib.contextmanager
    def counter(self, desc: str, unit: str, done: str | None = None) -> Iterator[Callable[[int], None]]:
        """A bar counting up to an unknown total; yields ``update(count_so_far)``.

        ``done``: a line printed once the work succeeds, e.g. "tokenized X" -> "parallel3d:
        tokenized X (1,234 tok, 0.5 s)"; None for a caller that reports the result itself.
        """
        start, count = time.perf_counter(), 0
        bar = (tqdm(desc=desc, unit=unit, unit_scale=True, file=self.file, leave=False, dynamic_ncols=True)
               if self.live else None)

        def update(n: int) -> None:
            nonlocal count
            count = n
            if bar is not None:
                bar.update(n - bar.n)

        try:
            yield update
        finally:
            if bar is not None:
                bar.close()  # leave=False: the bar goes, the line below stays
        if done is not None:
            self.write(f"parallel3d: {done} ({count:,} {unit}, {time.perf_counter() - start:.1f} s)")


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
