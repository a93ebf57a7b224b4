"""build_setup and train_step in one process: the state a step reads, and what one step does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from parallel3d.config.compose import compose
from parallel3d.models.moe import moe_layers
from parallel3d.step import build_setup, train_step
from parallel3d.validate import check


def _setup(overrides: list[str]):
    cfg = check(compose(["train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=16",
                         "run_dir=/nonexistent", *overrides]), 1)
    return build_setup(OmegaConf.to_object(cfg), torch.device("cpu"))


def _batches(setup, n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    vocab, t = setup.config.model.vocab_size, setup.config.train
    return [(torch.randint(0, vocab, (t.micro_batch_size, t.seq_len), generator=g),
             torch.randint(0, vocab, (t.micro_batch_size, t.seq_len), generator=g)) for _ in range(n)]


@pytest.mark.fast
def test_one_step_returns_the_mean_token_loss_and_updates_the_weights():
    setup = _setup([])
    assert setup.pipeline is None and setup.tied is None and setup.parts == [setup.model]
    assert setup.spec.num_micro_batches == 2
    batches = _batches(setup)
    inputs, targets = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    with torch.no_grad():
        expected = F.cross_entropy(setup.model(inputs).flatten(0, 1), targets.flatten())  # mean over all tokens
    before = setup.model.output.weight.detach().clone()
    lr_before = setup.scheduler.get_last_lr()[0]
    loss_sum, grad_norm, _ = train_step(setup, batches)
    torch.testing.assert_close(loss_sum, expected, rtol=1e-5, atol=1e-6)
    assert grad_norm > 0 and setup.model.output.weight.grad is not None  # the caller zeroes them
    assert not torch.equal(before, setup.model.output.weight)
    assert setup.scheduler.get_last_lr()[0] != lr_before  # the lr schedule stepped too (warmup)


def test_activation_checkpointing_reaches_the_model_through_the_plan():
    plain, checkpointed = _setup([]), _setup(["model.activation_checkpoint=full"])
    batches = _batches(plain)
    a, b = train_step(plain, batches), train_step(checkpointed, batches)
    torch.testing.assert_close(a[:2], b[:2])  # recomputation changes no number
    # apply_activation_checkpointing wraps each block's forward on the instance
    assert "forward" in vars(checkpointed.model.layers["0"]) and "forward" not in vars(plain.model.layers["0"])


@pytest.mark.fast
def test_the_step_moves_the_sigmoid_routers_bias_by_its_load():
    """The bias step follows the optimizer's inside train_step: each block's bias moves by
    bias_update_rate against the sign of (load - mean load) of the step's token copies."""
    setup = _setup(["model=tiny_moe", "model.moe.router=sigmoid", "model.moe.bias_update_rate=0.01"])
    layers = moe_layers(setup.model)
    expert_loads = train_step(setup, _batches(setup)).expert_loads  # the counters are reset by then
    for index, layer in enumerate(layers.values()):  # the MoE blocks in order, as the loads' rows
        loads = expert_loads.loads[index]
        expected = 0.01 * torch.sign(loads.mean() - loads).float()
        assert expected.any()
        torch.testing.assert_close(layer.router.expert_bias, expected)
