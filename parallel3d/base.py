"""Definitions every layer of parallel3d shares, with no parallel3d imports of its own.

The bottom of the import graph: validation, the Hugging Face interop, checkpoints, the planner
and the training loop all read these, so none of them has to import another for them.
"""

from __future__ import annotations

import os

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConfigError(ValueError):
    """A configuration that cannot run, explained for the person who wrote it."""

    def __init__(self, key: str, value: object, problem: str, fix: str):
        self.key, self.value = key, value
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


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))
