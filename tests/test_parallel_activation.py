"""Activation checkpointing and compile keep the numbers, and checkpointing saves memory."""

from __future__ import annotations

import pytest
import torch
from harness.parity import Matrix, layouts, prefetch_selected
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.models import Transformer
from parallel3d.parallel.activation import apply_activation_checkpointing
from parallel3d.validate import check

LAYOUTS = layouts({
    "dp2-zero3-ac-full": (2, ["parallel.zero_stage=3", "model.activation_checkpoint=full",
                              "train.micro_batch_size=4"]),
    "tp2-ac-selective": (2, ["parallel.tp=2", "model.activation_checkpoint=selective", "train.micro_batch_size=8"]),
    "pp2-ac-op": (2, ["parallel.pp=2", "model.activation_checkpoint=op", "train.micro_batch_size=2"]),
    # Op-level checkpointing replays recorded ops; the data-parallel wrappers' hooks must stay
    # outside what it replays (they once failed the first backward: parallel/activation.py).
    "dp2-zero3-ac-op": (2, ["parallel.zero_stage=3", "model.activation_checkpoint=op", "train.micro_batch_size=4"]),
    "dp2-zero1-ac-op": (2, ["parallel.zero_stage=1", "model.activation_checkpoint=op", "train.micro_batch_size=4"]),
    "compile": (1, ["model.compile=true", "train.micro_batch_size=8"]),
    "dp2-zero3-compile": (2, ["parallel.zero_stage=3", "model.compile=true", "train.micro_batch_size=8"]),
    "pp2-compile": (2, ["parallel.pp=2", "model.compile=true", "train.micro_batch_size=2"]),
})
MATRIX = Matrix(tuple(LAYOUTS))  # lent to other files' batches (harness/parity.py)


@pytest.fixture(scope="module", autouse=True)
def batched(parity, request):
    """The selected layouts train in a few launches instead of one each (tests/harness/layout_batch.py)."""
    prefetch_selected(request, parity, MATRIX)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_single_process(layout, parity):
    parity.assert_same_training(parity.train(layout))


def _forward_backward(mode: str) -> tuple[int, int]:
    """(bytes autograd saves in forward, matmul FLOPs of backward) for the tiny model."""
    cfg = OmegaConf.to_object(compose([f"model.activation_checkpoint={mode}"]).model)
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_activation_checkpointing(model, cfg.activation_checkpoint, cfg.activation_checkpoint_every)
    model.to_empty(device="cpu")
    model.init_weights(0)
    saved = []

    def pack(t):
        saved.append(0 if isinstance(t, torch.nn.Parameter) else t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(torch.randint(0, 256, (4, 128))).sum()
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return sum(saved), flops.get_total_flops()


@pytest.mark.fast
def test_checkpointing_trades_memory_for_recompute_as_documented():
    (none_mem, none_flops), (op_mem, op_flops), (sel_mem, sel_flops), (full_mem, full_flops) = (
        _forward_backward(m) for m in ("none", "op", "selective", "full"))
    assert full_mem < sel_mem < none_mem  # selective: every 2nd block keeps only its input
    assert none_flops < sel_flops < full_flops  # ... and recomputes its forward in backward
    # op: blocks keep matmul outputs (in the checkpoint's cache, not autograd's), so backward
    # recomputes no matmul at all, only the cheap ops around them.
    assert op_mem < none_mem and op_flops == none_flops


def test_compile_with_tensor_parallelism_is_refused():
    with pytest.raises(ConfigError) as err:
        check(compose(["parallel.tp=2", "model.compile=true"]), 2)
    assert err.value.key == "model.compile"
