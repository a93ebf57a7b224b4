"""Activation checkpointing and torch.compile, per transformer block.

Both act on the blocks in place and keep parameter names: checkpointing replaces a block's
``forward`` with a checkpointed call of the original, and ``nn.Module.compile`` compiles a module's
forward without an ``_orig_mod`` wrapper. So initial weights, checkpoints and parity do not depend
on them.

Why ``forward`` and not the module's call (torch's composable ``checkpoint`` hooks the call): data
parallelism adds hooks to each block too, and FSDP2 *prepends* its pre-forward hook. With the
composable API that hook ran outside the checkpointed region in forward but inside it when backward
re-ran the whole call, so op-level (selective) checkpointing, which replays the ops it recorded,
met FSDP's ops it had never seen and failed in the first backward. Checkpointing ``forward``
leaves every hook outside the region in both passes (FSDP's pre-backward hook gathers the
parameters before the recomputation needs them), as torch's ``checkpoint_wrapper`` does without
renaming the parameters.

    model.activation_checkpoint   what a block keeps for backward
    none                          everything
    full                          its input only; the rest is recomputed
    selective                     full, on every Nth block (model.activation_checkpoint_every)
    op                            matmul and attention outputs, and the tensor-parallel reductions
                                  after wo and w2; the cheap ops around them are recomputed

What a recomputed block communicates again under tensor parallelism (recomputation stops once it
has what backward needs, so the reduction after w2 is never repeated): full repeats the two
sequence all-gathers and the reduce-scatter after wo (without sequence parallelism: the
all-reduce after wo); op repeats the all-gathers only, their outputs being full-sequence tensors
too large to keep, while its reductions come from the cache.
"""

from __future__ import annotations

from functools import partial, wraps

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

AC_MODES = ("none", "full", "selective", "op")

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
# Expensive to recompute: keep their outputs under op-level selective checkpointing. The
# reductions are residual-sized (1/tp of the sequence under sequence parallelism) and would
# otherwise be communicated again.
SAVED_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _c10d.reduce_scatter_tensor.default, _c10d.all_reduce.default,
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
        _checkpoint_forward(block, **extra)


def _checkpoint_forward(block: nn.Module, **options) -> None:
    """Recompute ``block``'s forward in backward; its hooks stay outside (see the docstring)."""
    forward = block.forward

    @wraps(forward)
    def checkpointed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **options, **kwargs)

    block.forward = checkpointed


def compile_blocks(model: nn.Module) -> None:
    """Compile each block separately: identical blocks share one compiled graph, and FSDP's
    per-block hooks stay outside the graph."""
    for block in model.layers.values():
        block.compile()
