"""Definitions every layer of parallel3d shares, with no parallel3d imports of its own.

The bottom of the import graph: validation, the Hugging Face interop, checkpoints, the planner
and the training loop all read these, so none of them has to import another for them.
"""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GIB = 2**30
SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(ValueError):
    """A configuration that cannot run, explained for the person who wrote it."""

    def __init__(self, key: str, value: object, problem: str, fix: str):
        self.key, self.value, self.problem, self.fix = key, value, problem, fix
        super().__init__(f"{key}={value}: {problem}. Fix: {fix}.")


class RunError(RuntimeError):
    """A failure at run time that we can name: the message says which file and what to do."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_device(device: str, available: str | None = None) -> str:
    """``train.device`` made concrete: auto picks the GPU when the machine (or ``available``) has one."""
    if device == "auto":
        return available or ("cuda" if torch.cuda.is_available() else "cpu")
    return device


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor: a run that never made one (one
    process, no tensor or data parallelism) never pays torch.distributed.tensor's import, and until
    something imported it no value can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``value``: a DTensor's local shard, any other tensor itself."""
    return value.to_local() if is_dtensor(value) else value


def is_checkpoint_exception(error: BaseException) -> bool:
    """Whether ``error`` is DCP's CheckpointException (a BaseException, not an Exception), without
    importing DCP: a run that never saved or loaded one never raised one."""
    module = sys.modules.get("torch.distributed.checkpoint.api")
    return module is not None and isinstance(error, module.CheckpointException)


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank: the process group's once one is up, else torchrun's ``RANK`` (0 alone)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def parse_size(text: str, *, bare_unit: int = 1) -> int:
    """``5GB`` (10**9, as transformers and disks count), ``80GiB`` (2**30), ``2e6``; a bare number
    counts in ``bare_unit`` bytes. Raises ValueError naming the text and the accepted forms."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit is None or (unit and unit not in SIZE_UNITS):
        raise ValueError(f"not a size: {text!r} (say 5GB, 500MB, 80GiB or a number)")
    return int(float(match.group(1)) * (SIZE_UNITS[unit] if unit else bare_unit))


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Every rank's ``tensor`` of ``group`` into ``output`` (rank-major): ``dist.all_gather_single``
    where torch has it (there ``all_gather_into_tensor`` is deprecated and warns on every run),
    else ``all_gather_into_tensor``, its older name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)
