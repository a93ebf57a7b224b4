"""What a run says about itself before its first step: the banner (its first console line, which
README shows; tests/test_docs.py keeps the two equal) and, under LoRA, what the adapters train."""

from __future__ import annotations

from pathlib import Path

import torch

from parallel3d.config.schema import Config
from parallel3d.models import Transformer, num_params
from parallel3d.models.lora import apply_lora, describe_targets
from parallel3d.parallel.mesh import ParallelDims
from parallel3d.step import Setup


def print_banner(c: Config, setup: Setup, world_size: int, run_dir: Path) -> None:
    print(banner(c, setup.dims, setup.device.type, world_size, run_dir), flush=True)
    if c.model.lora.rank:
        print(lora_line(c.model), flush=True)


def lora_line(m) -> str:
    """What LoRA trains: the adapters' parameters against the whole model's."""
    with torch.device("meta"):
        model = Transformer(m)
    apply_lora(model, m.lora)
    trainable, total = (sum(p.numel() for p in model.parameters() if p.requires_grad or not only)
                        for only in (True, False))
    return (f"parallel3d: LoRA rank {m.lora.rank} alpha {m.lora.alpha:g} on {describe_targets(m)}: "
            f"{trainable / 1e6:.2f}M trainable parameters ({100 * trainable / total:.2f}% of {total / 1e6:.2f}M), "
            f"the rest frozen")


def banner(c: Config, dims: ParallelDims, device_type: str, world_size: int, run_dir: Path) -> str:
    """The run's first console line (the README shows it; tests/test_docs.py keeps the two equal)."""
    with torch.device("meta"):  # the whole model's size, whatever part of it this rank holds
        size = num_params(Transformer(c.model))
    return (f"parallel3d | {c.recipe or 'custom'} | model {c.model.name} {size / 1e6:.2f}M params | "
            f"{world_size} ranks {dims.sizes()} zero_stage {c.parallel.zero_stage} | {device_type} | "
            f"run_dir {run_dir}")
