"""What can go wrong saving or loading a checkpoint, said in one line.

DCP gathers every rank's failure into one ``CheckpointException``, a ``BaseException`` (not an
``Exception``) whose message is every rank's traceback; an ``OSError`` says errno and path but
not what to do. ``checkpoint_errors`` turns both into a ``CheckpointError``: one line naming the
file, what happened (a full disk named as such) and the fix. The traceback stays attached
(``__cause__``) for the rank log.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import torch

from parallel3d.base import RunError, is_checkpoint_exception, local_tensor


class CheckpointError(RunError):
    """A checkpoint that could not be saved or loaded. ``every_rank``: every rank raises this same
    error (DCP and our agreement step share it), so only rank 0 needs to print it."""

    def __init__(self, message: str, *, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class NonFiniteState(CheckpointError):
    """The model or optimizer holds NaN or Inf at a save: it is not written."""


def first_failure(error: BaseException) -> BaseException:
    """The underlying error of the lowest failing rank of a CheckpointException."""
    while is_checkpoint_exception(error) and error.failures:
        error = error.failures[min(error.failures)][0]
    return error


class ChecksumMismatch(RunError):
    """A block (checkpoint/reader.py) a load was about to copy from does not match the checkpoint's manifest."""


def mismatch_of(error: BaseException) -> str | None:
    """The ChecksumMismatch line behind a failed load (a CheckpointError from DCP's), or None."""
    cause = first_failure(error.__cause__ if error.__cause__ is not None else error)
    return str(cause) if isinstance(cause, ChecksumMismatch) else None


def failure_line(error: BaseException, path: Path, saving: bool) -> str:
    """One line: which file, what went wrong, and the fix."""
    cause = first_failure(error)
    where = Path(getattr(cause, "filename", None) or path)
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return (f"disk full writing {where}: free space on its file system (or set checkpoint.keep_last lower, "
                f"or run_dir elsewhere) and run again; the previous checkpoint is intact and the run resumes from it")
    text = " ".join(str(cause).split()) or type(cause).__name__
    if isinstance(cause, OSError):
        text = f"{cause.strerror or text} ({where})"
    elif not isinstance(cause, RunError):
        text = f"{type(cause).__name__}: {text}"[:300]
    if saving:
        return (f"saving {path} failed: {text}. Fix: check that {path.parent} is writable and has space; "
                f"the previous checkpoint is intact and the run resumes from it")
    return (f"loading {path} failed: {text}. Fix: check the file system, or resume from an earlier checkpoint "
            f"(checkpoint.resume=PATH)")


@contextlib.contextmanager
def checkpoint_errors(path: Path, *, saving: bool, every_rank: bool = False):
    """Re-raise a CheckpointException or OSError inside as a one-line CheckpointError. DCP raises
    its exceptions on every rank, so those are ``every_rank`` whatever is passed."""
    try:
        yield
    except CheckpointError:
        raise
    except (OSError, RunError) as e:
        raise CheckpointError(failure_line(e, path, saving), every_rank=every_rank) from e
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if not is_checkpoint_exception(e):
            raise
        raise CheckpointError(failure_line(e, path, saving), every_rank=True) from e


def nonfinite_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The keys of tensors (this rank's shards) holding NaN or Inf: one flag per tensor, one sync."""
    floating = [(k, local_tensor(t)) for k, t in tensors.items()
                if t.is_floating_point()]
    if not floating:
        return []
    finite = torch.stack([torch.isfinite(t).all() for _, t in floating]).cpu()
    return [k for (k, _), ok in zip(floating, finite.tolist()) if not ok]
