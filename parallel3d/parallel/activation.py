"""Activation checkpointing and torch.compile, per transformer block.

Both act on the blocks in place and keep parameter names: torch's composable ``checkpoint``
hooks a module instead of wrapping it, and ``nn.Module.compile`` compiles a module's forward
without an ``_orig_mod`` wrapper. So initial weights, checkpoints and parity do not depend on them.

    model.activation_checkpoint   what a block keeps for backward
    none                          everything
    full                          its input only; the rest is recomputed
    selective                     full, on every Nth block (model.activation_checkpoint_every)
    op                            matmul and attention outputs; the cheap ops around them are recomputed
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective", "op")

_aten = torch.ops.aten
# Expensive to recompute: keep their outputs under op-level selective checkpointing.
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """Checkpoint this model's (or pipeline stage's) blocks; ``every`` counts full-model block indices."""
    if mode == "none":
        return
    for name, block in model.layers.items():
        if mode == "selective" and int(name) % every:
            continue
        extra = {"context_fn": partial(create_selective_checkpoint_contexts, _save_matmuls)} if mode == "op" else {}
        checkpoint(block, preserve_rng_state=False, **extra)


def compile_blocks(model: nn.Module) -> None:
    """Compile each block separately: identical blocks share one compiled graph, and FSDP's
    per-block hooks stay outside the graph."""
    for block in model.layers.values():
        block.compile()
