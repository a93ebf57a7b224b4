"""The progress display: bars with '\\r' redraws on a terminal only, plain lines everywhere else."""

from __future__ import annotations

import fcntl
import io
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
from harness.runs import env

from parallel3d.progress import Progress

ETA = re.compile(r"\d+/6 \[\d\d:\d\d<\d\d:\d\d, ")  # tqdm's "n/total [elapsed<remaining, rate"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _train_six_steps(progress: Progress) -> None:
    """What the training loop does with its display: six steps, a checkpoint saved after step 3."""
    progress.start(6)
    for step in range(1, 7):
        time.sleep(0.01)  # a measurable rate, so the bar has an ETA
        progress.update(step)
        progress.write(f"[{step}/6] loss {5 - step * 0.5:.4f}", loss=5 - step * 0.5)
        if step == 3:
            progress.saving("step_3")
            progress.saved("step_3")
    progress.close()


def _lines(text: str) -> list[str]:
    """What a terminal ends up showing: each line's text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def test_terminal_gets_a_redrawn_bar_with_eta_loss_and_checkpoint_status():
    term = FakeTerminal()
    _train_six_steps(Progress(enabled=True, file=term, out=term))
    text = term.getvalue()
    assert "\r" in text and ETA.search(text), text
    assert "6/6 [" in text and "loss=2.0000" in text  # the final redraw: all steps, the last loss
    assert "train (saving step_3)" in text  # shown while the save runs
    shown = _lines(text)
    for step in range(1, 7):  # each log line whole on a line of its own, above the bar
        assert f"[{step}/6] loss {5 - step * 0.5:.4f}" in shown
    assert any(re.fullmatch(r"parallel3d: saved checkpoint step_3 \(\d+\.\d s\)", line) for line in shown)


@pytest.mark.fast
def test_not_a_terminal_gets_plain_lines_only():
    out, bars = io.StringIO(), io.StringIO()
    _train_six_steps(Progress(enabled=True, file=bars, out=out))
    assert bars.getvalue() == ""
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[:3] == ["[1/6] loss 4.5000", "[2/6] loss 4.0000", "[3/6] loss 3.5000"]
    assert re.fullmatch(r"parallel3d: saved checkpoint step_3 \(\d+\.\d s\)", lines[3])
    assert lines[4:] == ["[4/6] loss 3.0000", "[5/6] loss 2.5000", "[6/6] loss 2.0000"]


def test_data_preparation_counts_on_a_terminal_and_reports_one_line_anywhere():
    for stream, live in ((FakeTerminal(), True), (io.StringIO(), False)):
        with Progress(enabled=True, file=stream, out=stream).counter("tokenizing", "tok", done="tokenized x") as update:
            for n in range(0, 50_000, 1000):
                update(n)
        text = stream.getvalue()
        assert ("tokenizing" in text and "\r" in text) == live, text
        assert re.fullmatch(r"parallel3d: tokenized x \(49,000 tok, \d+\.\d s\)", _lines(text)[-2]), text
        assert text.count("\n") == 1  # the bar leaves no line behind


def test_other_ranks_show_nothing(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    term = FakeTerminal()
    progress = Progress(file=term, out=term)
    assert not progress.enabled
    _train_six_steps(progress)
    with progress.counter("tokenizing", "tok", done="tokenized x") as update:
        update(10)
    assert term.getvalue() == ""


def test_tqdm_disable_turns_the_bars_off_on_a_terminal():
    # tqdm reads TQDM_* when it is imported: hence a fresh interpreter.
    script = ("import io, sys; sys.path.insert(0, 'tests'); from test_progress import FakeTerminal, _train_six_steps; "
              "from parallel3d.progress import Progress; t = FakeTerminal(); "
              "_train_six_steps(Progress(enabled=True, file=t, out=t)); sys.stdout.write(t.getvalue())")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**env(), "TQDM_DISABLE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "\r" not in proc.stdout and "[6/6] loss 2.0000" in proc.stdout and "saved checkpoint" in proc.stdout


# --- end to end: a training run in a terminal and through pipes ----------------------------------

SHORT = ["train.steps=6", "checkpoint.every=3", "optim.warmup_steps=1", "data.max_bytes=100000"]


def _command(tmp_path, name: str) -> list[str]:
    # A corpus cache of its own: the run tokenizes, so the data preparation display shows too.
    return [sys.executable, "-m", "parallel3d.train", f"run_dir={tmp_path / name}",
            f"data.cache_dir={tmp_path / name / 'cache'}", *SHORT]


def _in_terminal(cmd: list[str], cwd, timeout: float = 120) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal as its stdin, stdout and stderr; all it wrote there."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env(), cwd=cwd)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                proc.kill()
                raise AssertionError(f"no end after {timeout}s:\n" + b"".join(chunks).decode(errors="replace"))
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed its side (Linux)
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")


def test_training_in_a_terminal_shows_bars_and_through_pipes_plain_lines(tmp_path):
    rc, shown = _in_terminal(_command(tmp_path, "tty"), tmp_path)
    assert rc == 0, shown[-3000:]
    assert "tokenizing the default corpus" in shown and "tokenized the standard library" in shown
    assert ETA.search(shown) and "6/6 [" in shown, shown[-3000:]
    assert "saving step_3" in shown and "saving step_6" in shown  # the status while each save runs
    assert "parallel3d: saved checkpoint step_3 (" in shown
    assert "[6/6] loss" in shown  # the per-step lines still print, above the bar

    piped = subprocess.run(_command(tmp_path, "pipe"), capture_output=True, text=True, timeout=120, env=env(),
                           cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "\r" not in piped.stdout + piped.stderr
    lines = piped.stdout.splitlines()
    assert sum(bool(re.match(r"\[\d/6\] loss ", line)) for line in lines) == 6
    assert sum(line.startswith("parallel3d: saved checkpoint step_") for line in lines) == 2
    assert sum(line.startswith("parallel3d: tokenized the standard library") for line in lines) == 1
    assert "saving step_" not in piped.stdout + piped.stderr  # a live status only
