"""Learning-rate schedules, the scheduler on a real optimizer, gradient clipping, AdamW variants."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from harness.gloo_ranks import fork_gloo_ranks
from torch import nn

from parallel3d.config.schema import OptimConfig
from parallel3d.optim.adamw import build_optimizer
from parallel3d.optim.clip import clip_grad_norm_, perturb_gradients, total_norm
from parallel3d.optim.schedule import build_lr_scheduler, lr_factor

STEPS, WARMUP, MIN_RATIO = 40, 5, 0.1


def factors(schedule: str, steps: int = STEPS, warmup: int = WARMUP, min_ratio: float = MIN_RATIO,
            decay_fraction: float = 0.2) -> list[float]:
    """The factor of every optimizer step of a run (LambdaLR counts 0 .. steps - 1)."""
    f = partial(lr_factor, steps=steps, warmup=warmup, schedule=schedule, min_ratio=min_ratio,
                decay_fraction=decay_fraction)
    return [f(s) for s in range(steps)]


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_linear_warmup_reaches_peak_at_last_warmup_step(schedule):
    f = factors(schedule)
    assert f[:WARMUP] == pytest.approx([(s + 1) / WARMUP for s in range(WARMUP)])
    assert all(a < b for a, b in zip(f[: WARMUP - 1], f[1:WARMUP]))  # strictly increasing
    assert f[WARMUP - 1] == pytest.approx(1.0)
    assert f[0] > 0  # the first step already trains


def test_cosine_is_monotone_after_warmup_and_clamped_at_min():
    f = factors("cosine")
    after = f[WARMUP - 1 :]
    assert all(b <= a + 1e-12 for a, b in zip(after, after[1:]))
    assert after[0] == pytest.approx(1.0)
    assert min(f[WARMUP:]) >= MIN_RATIO - 1e-12
    # Half way through the decay the cosine is half way between peak and floor.
    steps = WARMUP + 20  # decay from the peak at step WARMUP - 1 to the floor at step steps - 1
    assert lr_factor(WARMUP + 9, steps=steps, warmup=WARMUP, schedule="cosine", min_ratio=MIN_RATIO,
                     decay_fraction=0.2) == pytest.approx((1 + MIN_RATIO) / 2)
    # Beyond the end of the run the factor stays at the floor.
    for step in (STEPS, STEPS + 7):
        assert lr_factor(step, steps=STEPS, warmup=WARMUP, schedule="cosine", min_ratio=MIN_RATIO,
                         decay_fraction=0.2) == pytest.approx(MIN_RATIO)


def test_cosine_ends_at_min_ratio_at_final_step():
    f = factors("cosine")
    assert f[-1] == pytest.approx(MIN_RATIO)


@pytest.mark.fast
def test_wsd_flat_then_linear_decay_to_min_ratio():
    decay_fraction = 0.25
    f = factors("wsd", decay_fraction=decay_fraction, min_ratio=0.0)
    decay_steps = round(decay_fraction * STEPS)
    decay_start = STEPS - decay_steps
    assert f[WARMUP - 1 : decay_start] == [1.0] * (decay_start - WARMUP + 1)
    decay = f[decay_start:]
    assert all(b < a for a, b in zip([1.0, *decay], decay))  # strictly decreasing from the plateau
    steps_ = [b - a for a, b in zip([1.0, *decay], decay)]
    assert steps_ == pytest.approx([-1 / (decay_steps + 1)] * decay_steps)  # linear, from the plateau
    # The floor comes when the run ends, after the last update: the last step still trains.
    assert f[-1] == pytest.approx(1 / (decay_steps + 1)) and f[-1] > 0
    assert lr_factor(STEPS, steps=STEPS, warmup=WARMUP, schedule="wsd", min_ratio=0.0,
                     decay_fraction=decay_fraction) == pytest.approx(0.0)


def test_wsd_default_config_never_steps_at_lr_zero():
    """conf/optim/adamw_wsd.yaml decays to min_lr_ratio=0: no optimizer step may run at lr 0."""
    from parallel3d.config.compose import compose

    o = compose(["optim=adamw_wsd"]).optim
    for steps in (1, 2, 10, 40, 1000):
        f = factors("wsd", steps=steps, warmup=min(o.warmup_steps, steps), min_ratio=o.min_lr_ratio,
                    decay_fraction=o.decay_fraction)
        assert min(f) > 0, steps


def test_wsd_decays_towards_nonzero_min_ratio():
    f = factors("wsd", min_ratio=MIN_RATIO)
    assert MIN_RATIO < f[-1] < f[-2]
    assert lr_factor(STEPS, steps=STEPS, warmup=WARMUP, schedule="wsd", min_ratio=MIN_RATIO,
                     decay_fraction=0.2) == pytest.approx(MIN_RATIO)


def test_constant_stays_at_peak_after_warmup():
    f = factors("constant")
    assert f[WARMUP - 1 :] == [1.0] * (STEPS - WARMUP + 1)


def test_no_warmup_starts_at_peak():
    for schedule in ("cosine", "wsd", "constant"):
        assert factors(schedule, warmup=0)[0] == pytest.approx(1.0)


@pytest.mark.parametrize("schedule", ["cosine", "wsd", "constant"])
def test_scheduler_drives_adamw_lr(schedule):
    cfg = OptimConfig(lr=2e-3, schedule=schedule, warmup_steps=3, min_lr_ratio=0.2, decay_fraction=0.3)
    steps = 12
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([param], lr=cfg.lr)
    scheduler = build_lr_scheduler(optimizer, cfg, steps)
    expected = factors(schedule, steps=steps, warmup=3, min_ratio=0.2, decay_fraction=0.3)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        assert scheduler.get_last_lr()[0] == pytest.approx(seen[-1])
        param.grad = torch.ones_like(param)
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([cfg.lr * f for f in expected])


def _params_with_grads(*grads: list[float]) -> list[nn.Parameter]:
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        params.append(p)
    return params


@pytest.mark.fast
def test_clip_grad_norm_scales_down_to_max_norm():
    params = _params_with_grads([3.0, 0.0], [0.0, 4.0, 12.0])  # global norm sqrt(9 + 16 + 144) = 13
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert norm.item() == pytest.approx(13.0)
    after = math.sqrt(sum(float(p.grad.square().sum()) for p in params))
    assert after == pytest.approx(1.0, rel=1e-5)
    for p, g in zip(params, before):  # same direction, scaled by max_norm / norm
        torch.testing.assert_close(p.grad, g / 13.0, rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_below_max_leaves_grads():
    params = _params_with_grads([0.3, 0.4])
    norm = clip_grad_norm_(params, max_norm=1.0)
    assert norm.item() == pytest.approx(0.5)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.3, 0.4]))


def test_clip_grad_norm_zero_only_measures():
    params = _params_with_grads([30.0, 40.0], [0.0])
    norm = clip_grad_norm_(params, max_norm=0)
    assert norm.item() == pytest.approx(50.0)
    assert params[0].grad.tolist() == [30.0, 40.0]


def test_clip_grad_norm_skips_params_without_grad():
    params = _params_with_grads([6.0, 8.0])
    params.append(nn.Parameter(torch.ones(4)))  # no .grad (e.g. frozen or unused)
    norm = clip_grad_norm_(params, max_norm=5.0)
    assert norm.item() == pytest.approx(10.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([3.0, 4.0]))
    assert params[1].grad is None


def test_clip_grad_norm_accepts_a_generator_like_torch():
    model = nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.tensor([[30.0, 40.0]])
    norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
    assert norm.item() == pytest.approx(50.0)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[0.6, 0.8]]))


def _clip_on_two_ranks(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from parallel3d.optim.clip import _split_group

    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(0)
    whole = [torch.randn(shape, generator=generator) for shape in [(6, 4), (5,), (3, 3)]]  # 5, 3: uneven
    exact = torch.linalg.vector_norm(torch.cat([w.flatten() for w in whole]).double()).item()
    # FSDP's layout (every gradient split alike: this rank's shards, one all-reduce), then a mixed
    # one (DTensor reduces it)
    for placements, group in [([Shard(0)] * 3, mesh.get_group(0)), ([Shard(0), Replicate(), Shard(1)], False)]:
        params = []
        for w, placement in zip(whole, placements):
            p = nn.Parameter(distribute_tensor(torch.zeros_like(w), mesh, [placement]))
            p.grad = distribute_tensor(w.clone(), mesh, [placement])
            params.append(p)
        assert _split_group([p.grad for p in params]) is group
        norm = clip_grad_norm_(params, max_norm=1.0)
        assert norm.item() == pytest.approx(exact, rel=1e-12), placements
        for p, w in zip(params, whole):
            torch.testing.assert_close(p.grad.full_tensor(), w / exact, rtol=1e-5, atol=1e-7)


@pytest.mark.multirank
def test_clip_grad_norm_of_sharded_gradients_is_the_whole_norm():
    fork_gloo_ranks(_clip_on_two_ranks)


def _tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


@pytest.mark.parametrize("implementation", ["auto", "foreach", "for_loop", "fused"])
def test_build_optimizer_implementations_step_on_cpu(implementation):
    cfg = OptimConfig(lr=1e-2, beta1=0.8, beta2=0.9, eps=1e-7, weight_decay=0.05, implementation=implementation,
                      no_decay=[])  # one group: every trainable parameter decays
    model = _tiny_net()
    model[0].bias.requires_grad_(False)  # frozen parameters are left out
    optimizer = build_optimizer(model, cfg)
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert group["lr"] == cfg.lr and group["betas"] == (0.8, 0.9)
    assert group["eps"] == cfg.eps and group["weight_decay"] == cfg.weight_decay
    flags = {"auto": (None, True), "foreach": (True, None), "for_loop": (False, None), "fused": (None, True)}
    assert (group["foreach"], group["fused"] or None) == flags[implementation]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert [id(p) for p in group["params"]] == [id(p) for p in trainable]

    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(1)), torch.zeros(16, 1)
    frozen = model[0].bias.detach().clone()
    before = [p.detach().clone() for p in trainable]
    losses = []
    for _ in range(5):
        loss = nn.functional.mse_loss(model(x), y) + 1.0
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, trainable))
    assert torch.equal(model[0].bias, frozen)
    assert losses[-1] < losses[0]


@pytest.mark.fast
def test_build_optimizer_implementations_agree():
    """Every implementation computes the same AdamW update."""
    results = {}
    for implementation in ("foreach", "for_loop", "fused"):
        model = _tiny_net()
        optimizer = build_optimizer(model, replace(OptimConfig(), implementation=implementation))
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
        for _ in range(3):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        results[implementation] = [p.detach() for p in model.parameters()]
    for implementation in ("for_loop", "fused"):
        for a, b in zip(results["foreach"], results[implementation]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _decay_of(optimizer) -> dict[int, float]:
    return {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}


def test_norms_get_no_weight_decay_and_the_rest_does():
    from parallel3d.config.schema import ModelConfig
    from parallel3d.models import Transformer

    model = Transformer(ModelConfig(n_layers=2))
    decay = _decay_of(build_optimizer(model, OptimConfig()))
    names = {name: decay[id(p)] for name, p in model.named_parameters()}
    assert len(names) == len(decay)  # every parameter, once
    assert {n for n, wd in names.items() if wd == 0.0} == {
        "norm.weight", *(f"layers.{i}.{k}_norm.weight" for i in range(2) for k in ("attention", "ffn"))}
    assert names["tok_embeddings.weight"] == names["layers.1.feed_forward.w2.weight"] == 0.1


def test_no_decay_patterns_can_exempt_the_embedding_and_an_empty_group_is_dropped():
    from parallel3d.config.schema import ModelConfig
    from parallel3d.models import Transformer

    model = Transformer(ModelConfig(n_layers=1))
    cfg = replace(OptimConfig(), no_decay=["*norm*", "tok_embeddings.*"])
    names = {name: _decay_of(build_optimizer(model, cfg))[id(p)] for name, p in model.named_parameters()}
    assert names["tok_embeddings.weight"] == 0.0 and names["output.weight"] == 0.1
    only = build_optimizer(model, replace(OptimConfig(), no_decay=[]))
    assert [g["weight_decay"] for g in only.param_groups] == [0.1]


def test_a_no_decay_parameter_is_not_shrunk_by_a_step():
    """With zero gradients AdamW's only change is the decay: a norm gain stays, a weight shrinks."""
    model = nn.Sequential()
    model.add_module("norm", nn.LayerNorm(4, bias=False))
    model.add_module("proj", nn.Linear(4, 4, bias=False))
    optimizer = build_optimizer(model, replace(OptimConfig(), lr=0.5, weight_decay=0.1, implementation="for_loop"))
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert torch.equal(model.norm.weight, before[0])
    assert torch.allclose(model.proj.weight, before[1] * (1 - 0.5 * 0.1))


def test_total_norm_sums_in_float64():
    """Many float32 gradients: the norm equals the float64 one to its last bits, whatever their order."""
    torch.manual_seed(0)
    grads = [torch.randn(n) * scale for n, scale in zip(range(1, 400), torch.logspace(-4, 2, 399))]
    exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    assert total_norm(grads).dtype == torch.float64
    assert total_norm(grads).item() == pytest.approx(exact, rel=1e-12)
    assert total_norm(grads[::-1]).item() == pytest.approx(exact, rel=1e-12)
    assert total_norm([]).item() == 0.0


def _noisy(grads: list[torch.Tensor], **draw) -> list[torch.Tensor]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    perturb_gradients(params, relative=1e-7, **{"seed": 0, "draw": 0, "step": 1, **draw})
    return [p.grad for p in params]


def test_grad_noise_is_round_off_sized_deterministic_and_keeps_exact_zeros():
    """debug.grad_noise: noise of 1e-7 of each tensor's root mean square, the same for the same
    (seed, draw, step) and another for another; a zero element (a token no batch holds) stays zero."""
    torch.manual_seed(0)
    small, large = torch.randn(64, 32) * 1e-3, torch.randn(128) * 10.0
    small[3] = 0.0  # a whole row without gradient
    noisy = _noisy([small, large])
    for before, after in zip((small, large), noisy):
        rms = before.square().mean().sqrt()
        moved = (after - before).abs()
        assert 0 < moved.max() < 6e-7 * rms  # six sigma of 1e-7 x rms
        assert moved[before != 0].mean() > 0.5e-7 * rms  # every element moves, not only the large ones
    assert torch.equal(noisy[0][3], torch.zeros(32))
    assert all(torch.equal(a, b) for a, b in zip(noisy, _noisy([small, large])))
    for other in ({"draw": 1}, {"step": 2}, {"seed": 1}):
        assert not torch.equal(noisy[1], _noisy([small, large], **other)[1]), other


@pytest.mark.parametrize("overrides, world_size, words", [
    (["debug.grad_noise=1e-3"], 1, "not a round-off-sized perturbation"),
    (["debug.grad_noise=-1e-7"], 1, "not a round-off-sized perturbation"),
    (["debug.grad_noise=1e-7", "parallel.dp_shard=2"], 2, "perturbs a one-process reference run, not 2 ranks"),
    (["debug.grad_noise=1e-7", "checkpoint.every=5"], 1, "must not write checkpoints"),
])
def test_grad_noise_is_refused_outside_the_parity_measurement(overrides, world_size, words):
    from parallel3d.base import ConfigError
    from parallel3d.config.compose import compose
    from parallel3d.validate import check

    with pytest.raises(ConfigError, match=words) as refused:
        check(compose([*overrides, "run_dir=/nonexistent"]), world_size)
    assert "debug.grad_noise" in str(refused.value)


def _bpe_corpus(root) -> list[str]:
    """A byte-level BPE tokenizer (vocabulary within the tiny model's 512) and a corpus it encodes."""
    from harness.data_files import documents, write_jsonl
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = documents("bpe", 600)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end_of_text|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tok.save(str(root / "tokenizer.json"))
    return [f"data.sources=[{write_jsonl(root / 'bpe.jsonl', texts)}]", f"data.tokenizer={root / 'tokenizer.json'}",
            f"data.cache_dir={root / 'cache'}"]


@pytest.mark.multirank
def test_grad_norms_agree_across_layouts_at_adamw_default_eps(tmp_path):
    """One process, dp4 ZeRO-3 and dp2 x tp2 (one 4-rank launch) on a BPE corpus at AdamW's default
    eps=1e-8: losses and grad norms at every step within what the one-process run's own sensitivity
    implies (tests/harness/tolerance.py). At eps=1e-8 AdamW moves an element whose gradient is pure
    round-off by up to lr, in a direction the round-off picks, so the bound is wider than at the
    suite's eps=1e-6; the twin's noise, relative to each tensor's root mean square, reaches those
    elements as a reordered sum does. (The norm itself is summed in float64:
    test_total_norm_sums_in_float64.)"""
    from harness.runs import FAST, STEPS, launch, launch_batch, launch_measured
    from harness.parity import assert_matches

    overrides = [*FAST, *_bpe_corpus(tmp_path), "optim.eps=1e-8"]
    single, tolerance = launch_measured(tmp_path, [*overrides, "train.micro_batch_size=16"], steps=STEPS,
                                        metrics=("loss", "grad_norm"), weights=False)
    layouts = {"dp4-zero3": ["parallel.zero_stage=3", "train.micro_batch_size=4"],
               "dp2-tp2": ["parallel.tp=2", "train.micro_batch_size=8"]}
    runs = launch_batch(tmp_path, {name: [*overrides, *layout] for name, layout in layouts.items()}, nproc=4)
    for name, layout in layouts.items():  # one the batch did not finish runs on its own
        run = runs[name] if name in runs else launch(tmp_path / name, [*overrides, *layout], nproc=4)
        run.assert_finished(STEPS)
        assert_matches(single, run, tolerance=tolerance, metrics=("loss", "grad_norm"))
