"""Mixture of experts (parallel3d/models/moe.py): routing, dropless experts against a per-token
reference, the aux loss's value and gradient, published sizes, Qwen3's q/k norm."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from parallel3d.config.compose import compose
from parallel3d.config.schema import ModelConfig, MoEConfig
from parallel3d.models.llama import Transformer, flops_per_token, num_params
from parallel3d.models.moe import MoE, moe_layers
from parallel3d.parallel.activation import apply_activation_checkpointing


def tiny(**moe) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64,
                       moe=MoEConfig(**{"num_experts": 4, "top_k": 2, "expert_ffn_dim": 16, **moe}))


def build(cfg: ModelConfig, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


def tokens(layer: MoE) -> torch.Tensor:
    """Token copies per expert over every training forward since the last reset."""
    return layer.step_stats(len(layer.forward_stats))[0]


def per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts one at a time: what the sorted, grouped path must equal."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen, _ = moe.router(flat)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    rows = []
    for t in range(flat.shape[0]):
        y = torch.zeros_like(flat[t])
        for j in range(chosen.shape[1]):
            e = chosen[t, j]
            y = y + weights[t, j] * (w2[e] @ (F.silu(w1[e] @ flat[t]) * (w3[e] @ flat[t])))
        rows.append(y if moe.shared is None else y + moe.shared(flat[t]))
    return torch.stack(rows).view_as(x)


@pytest.mark.fast
@pytest.mark.parametrize("moe", [
    {},
    {"norm_topk_prob": False, "shared_experts": 1},
    {"router": "sigmoid", "top_k": 3},
])
def test_grouped_experts_equal_per_token_computation(moe):
    model = build(tiny(**moe))
    layer = model.layers["0"].feed_forward
    if layer.moe.router == "sigmoid":  # a non-zero bias must steer the choice, not the weights
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.3, 0.0, 0.1]))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(layer(x), per_token_reference(layer, x), rtol=1e-5, atol=1e-6)


def test_sigmoid_bias_changes_choice_not_weights():
    layer = build(tiny(router="sigmoid", norm_topk_prob=False, top_k=1)).layers["0"].feed_forward
    x = torch.randn(16, 32)
    layer.router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))
    weights, chosen, _ = layer.router(x)
    assert (chosen == 0).all()
    torch.testing.assert_close(weights[:, 0], layer.router.gate(x)[:, 0].sigmoid())


def test_aux_loss_value_and_gradient_join_the_loss():
    """The balance loss is E/(K*S) sum_i count_i mean_score_i per sequence, times the coefficient,
    over the rank's sequences per step; backward adds its gradient to the router's."""
    cfg = tiny(aux_loss_coef=0.5)
    layer = build(cfg).layers["0"].feed_forward
    layer.sequences_per_step = 4  # this micro batch: 2 of the step's 4 sequences
    x = torch.randn(2, 8, 32)
    out = layer(x)
    _, chosen, scores = layer.router(x.reshape(-1, 32))
    counts = F.one_hot(chosen.view(2, -1), 4).sum(1).float()
    expected = 0.5 * ((4 / (2 * 8)) * counts * scores.view(2, 8, 4).mean(1)).sum() / 4
    _, aux = layer.step_stats(1)
    torch.testing.assert_close(aux.float(), expected.detach())
    assert tokens(layer).sum() == 2 * 8 * 2

    out.sum().backward()
    with_aux = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    plain = layer.moe
    layer.moe = replace(plain, aux_loss_coef=0.0)
    out_no_aux = layer(x)
    (out_no_aux.sum() + expected).backward()  # the same loss, the aux term added by hand
    torch.testing.assert_close(with_aux, layer.router.gate.weight.grad, rtol=1e-5, atol=1e-7)


def test_every_places_moe_blocks_and_checkpointing_counts_once():
    cfg = replace(tiny(), n_layers=4, moe=replace(tiny().moe, every=2))
    model = build(cfg)
    assert list(moe_layers(model)) == ["1", "3"]
    apply_activation_checkpointing(model, "full", 1)
    model(torch.randint(0, 64, (2, 8))).sum().backward()  # recomputed in backward: still counted once
    assert all(tokens(layer).sum() == 2 * 8 * 2 for layer in moe_layers(model).values())


def test_flops_count_active_experts_only():
    dense = tiny()
    dense = replace(dense, moe=replace(dense.moe, num_experts=0))
    moe = tiny()
    # top_k=2 experts of 16 = one dense FFN of 32; plus the router (dim x experts).
    per_layer = 3 * 32 * (2 * 16) + 32 * 4 - 3 * 32 * 48
    assert flops_per_token(moe, 16) - flops_per_token(dense, 16) == 6 * 2 * per_layer


# Published totals (Hugging Face safetensors metadata): Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B,
# mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-0.6B (tied).
PUBLISHED = {"qwen3_30b_a3b": 30_532_122_624, "qwen3_235b_a22b": 235_093_634_560,
             "mixtral_8x7b": 46_702_792_704, "qwen3_0_6b": 596_049_920}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_counts(name):
    cfg = OmegaConf.to_object(compose([f"model={name}"]).model)
    with torch.device("meta"):
        assert num_params(Transformer(cfg)) == PUBLISHED[name]


def test_qk_norm_normalizes_each_head():
    cfg = replace(tiny(num_experts=0), qk_norm=True, head_dim=16)  # head_dim set apart from dim/n_heads
    model = build(cfg)
    attention = model.layers["0"].attention
    assert attention.wq.weight.shape == (4 * 16, 32) and attention.q_norm.weight.shape == (16,)
    assert model(torch.randint(0, 64, (1, 8))).shape == (1, 8, 64)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_sigmoid_router_bias_moves_towards_even_load_and_is_checkpointed(tmp_path):
    from parallel3d.checkpoint.checkpointer import Checkpointer
    from parallel3d.checkpoint.state import TrainState
    from parallel3d.config.schema import CheckpointConfig
    from parallel3d.parallel.expert import expert_metrics, reduce_expert_loads, update_router_bias

    cfg = tiny(router="sigmoid", bias_update_rate=0.01)
    model = build(cfg)
    model(torch.randint(0, 64, (2, 8)))
    loads = {name: tokens(layer) for name, layer in moe_layers(model).items()}
    expert_loads = reduce_expert_loads([model], cfg, micro_batches=1, world_group_size=1, device=torch.device("cpu"))
    update_router_bias([model], cfg, expert_loads)
    for name, layer in moe_layers(model).items():  # busier than the mean: down; idler: up
        expected = 0.01 * torch.sign(loads[name].mean() - loads[name]).float()
        assert expected.abs().sum() > 0
        torch.testing.assert_close(layer.router.expert_bias, expected)
    moved = {name: layer.router.expert_bias.clone() for name, layer in moe_layers(model).items()}
    stats = expert_metrics(expert_loads, dp=1)
    assert stats["expert_load"] == [int(v) for v in sum(loads.values()).tolist()]
    for name, layer in moe_layers(model).items():  # metrics read the loads and leave the bias alone
        assert torch.equal(layer.router.expert_bias, moved[name])
    checkpointer = Checkpointer(tmp_path, CheckpointConfig())
    checkpointer.save(1, TrainState([model]), {}, "model: {}\n")
    restored = build(cfg, seed=1)
    checkpointer.load(tmp_path / "checkpoints" / "step_1", TrainState([restored]))
    for name, layer in moe_layers(restored).items():
        assert torch.equal(layer.router.expert_bias, moe_layers(model)[name].router.expert_bias)


def test_statistics_never_move_the_router_bias():
    from parallel3d.parallel.expert import expert_metrics, reduce_expert_loads

    cfg = tiny(router="sigmoid", bias_update_rate=0.01)
    model = build(cfg)
    for _ in range(3):
        model(torch.randint(0, 64, (2, 8)))
        loads = reduce_expert_loads([model], cfg, micro_batches=1, world_group_size=1, device=torch.device("cpu"))
        expert_metrics(loads, dp=1)
    assert all(not layer.router.expert_bias.any() for layer in moe_layers(model).values())


def test_capacity_factor_zero_or_ample_is_dropless():
    """capacity_factor=0 (the default) and a factor no expert reaches give the dropless result bit for bit."""
    x = torch.randn(2, 8, 32)
    dropless = build(tiny()).layers["0"].feed_forward
    ample = build(tiny(capacity_factor=4.0)).layers["0"].feed_forward  # capacity = all 32 copies
    assert torch.equal(ample(x), dropless(x))
    assert ample.step_dropped(1) == 0 and torch.equal(tokens(ample), tokens(dropless))


def test_within_capacity_keeps_the_highest_weights_and_the_earlier_token_on_ties():
    from parallel3d.models.moe import within_capacity

    experts = torch.tensor([0, 1, 0, 0, 1, 0])
    weights = torch.tensor([0.2, 0.9, 0.5, 0.2, 0.1, 0.7])
    counts = torch.tensor([4, 2])
    keep = within_capacity(experts, weights, counts, capacity=2)
    assert keep.tolist() == [False, True, True, False, True, True]  # expert 0 keeps 0.7, 0.5
    keep = within_capacity(experts, weights, counts, capacity=3)
    assert keep.tolist() == [True, True, True, False, True, True]  # 0.2 tie: copy 0 before copy 3


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_capacity_drops_the_copies_over_capacity(capacity_factor):
    """Each expert computes at most ceil(cf * tokens * top_k / experts) copies, the ones with the
    highest routing weight; a dropped copy adds nothing to its token (no renormalization)."""
    layer = build(tiny(capacity_factor=capacity_factor, shared_experts=1)).layers["0"].feed_forward
    x = torch.randn(2, 8, 32)
    out = layer(x)
    flat = x.reshape(-1, 32)
    weights, chosen, _ = layer.router(flat)
    capacity = math.ceil(capacity_factor * 16 * 2 / 4)
    kept = torch.zeros_like(weights)
    for e in range(4):  # by hand: the expert's copies, highest weight first, the earlier token on ties
        copies = sorted(((-weights[t, j].item(), t, j) for t in range(16) for j in range(2) if chosen[t, j] == e))
        for _, t, j in copies[:capacity]:
            kept[t, j] = weights[t, j]
    layer.router.forward = lambda flat_x: (kept, chosen, None)  # the reference, with the drops as zero weights
    torch.testing.assert_close(out, per_token_reference(layer, x), rtol=1e-5, atol=1e-6)
    loads = torch.bincount(chosen.flatten(), minlength=4)
    assert torch.equal(layer.forward_stats[0][0], loads.clamp(max=capacity).double())
    assert layer.step_dropped(1) == int((loads - capacity).clamp(min=0).sum()) > 0
