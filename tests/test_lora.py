"""LoRA (parallel3d/models/lora.py, parallel3d/hf/lora.py): only the adapters train, every layout equals one process,
the planner counts the frozen base, and the exports (merged weights, PEFT adapter) are exact."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from harness.parity import PARITY_STEPS, SAVE_EVERY, Matrix, assert_matches, layouts, prefetch_selected
from safetensors.torch import load_file, save_file

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.config.schema import LoRAConfig, ModelConfig, OptimConfig
from parallel3d.hf import families
from parallel3d.models.lora import apply_lora, is_adapter
from parallel3d.validate import check

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]  # scale alpha / rank = 2
# One 4-rank launch: tp splits the adapters (column: B, row: A), ZeRO-3 with cp shards frozen and
# trainable parameters in one FSDP unit, pp stages hold their blocks' adapters (a zero-bubble
# schedule: its split weight backward meets the frozen base).
LAYOUTS = layouts({
    "dp2_tp2": (4, ["parallel.dp_shard=2", "parallel.tp=2", f"checkpoint.every={SAVE_EVERY}"]),
    "dp2_cp2_zero3": (4, ["parallel.dp_shard=2", "parallel.cp=2", "parallel.zero_stage=3"]),
    "dp2_pp2_zbv": (4, ["parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"]),
})
MATRIX = Matrix(tuple(LAYOUTS), prefix="lora-", extra=tuple(LORA))  # lent to other files' batches (harness/parity.py)


REFERENCE = ("lora-reference", [*LORA, "train.micro_batch_size=16"])  # one process (and its twins)


def resumed(parity) -> tuple[str, list[str]]:
    """One process resuming dp2 x tp2's step-SAVE_EVERY checkpoint (where that run is, or will be)."""
    saved = parity.run_dir("lora-" + LAYOUTS[0].name, LAYOUTS[0].nproc, [*LORA, *LAYOUTS[0].overrides])
    return "lora-resumed", [*LORA, "train.micro_batch_size=16", f"checkpoint.resume={saved}/checkpoints/step_{SAVE_EVERY}"]


@pytest.fixture(scope="module")
def lora_runs(request, parity):
    """The selected layouts and dp2 x tp2 (whose checkpoint the resume reads) in one 4-rank launch,
    then the one-process reference, its twins and the resume in one launch."""
    saving = LAYOUTS[0]
    prefetch_selected(request, parity, MATRIX, also={"lora-" + saving.name: (saving.nproc, [*LORA, *saving.overrides])})
    parity.prefetch_references(dict([REFERENCE]), others=dict([resumed(parity)]))
    return parity


@pytest.fixture(scope="module")
def lora_reference(lora_runs):
    return lora_runs.measured(*REFERENCE)[0]


@pytest.fixture(scope="module")
def lora_tolerance(lora_runs):
    """What the one-process run's own sensitivity implies (tests/harness/tolerance.py)."""
    return lora_runs.measured(*REFERENCE)[1]


@pytest.mark.fast
def test_only_adapters_train():
    cfg = ModelConfig(n_layers=2, lora=LoRAConfig(rank=4, alpha=8.0))
    with torch.device("meta"):
        from parallel3d.models import Transformer
        model = Transformer(cfg)
    apply_lora(model, cfg.lora)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable == {name for name, _ in model.named_parameters() if is_adapter(name)}
    assert all(p.abs().sum() == 0 for name, p in model.named_parameters() if name.endswith("lora_b"))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    from parallel3d.optim.adamw import build_optimizer
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {
        id(p) for _, p in model.named_parameters() if p.requires_grad}
    for _ in range(3):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        assert all(p.grad is None for name, p in model.named_parameters() if name not in trainable)
        optimizer.step()
        optimizer.zero_grad()
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in before if name not in trainable)
    assert all(not torch.equal(before[name], after[name]) for name in trainable)
    assert not torch.allclose(model(tokens[:, :-1]), logits)


@pytest.mark.parametrize("overrides, key", [
    (["parallel.tp=2", "model.lora.dropout=0.1"], "model.lora.dropout"),
    (["model.lora.targets=[wq,experts]"], "model.lora.targets"),
    (["model.lora.targets=[q_proj,w9]"], "model.lora.targets"),
    (["optim.name=muon"], "optim.name"),
])
def test_refusals(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check(compose([*LORA, *overrides]), 2 if "parallel.tp=2" in overrides else 1)


@pytest.mark.multirank
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_layouts_equal_one_process(parity, lora_reference, lora_tolerance, layout):
    """Losses, grad norms and final weights (adapters included) of each layout equal one process's;
    ``parity.run`` also holds each run's measured model-state bytes to the planner's."""
    assert_matches(lora_reference, parity.train(layout, prefix="lora-", extra=LORA), tolerance=lora_tolerance,
                   weights=True)


@pytest.mark.multirank
def test_resume_at_another_layout(parity, lora_reference, lora_tolerance):
    """dp2 x tp2's step-5 checkpoint (adapters and their optimizer state split over dp and tp)
    resumed by one process continues as the one-process run did."""
    run = parity.train(LAYOUTS[0], prefix="lora-", extra=LORA)
    name, overrides = resumed(parity)
    assert overrides[-1] == f"checkpoint.resume={run.run_dir / 'checkpoints' / f'step_{SAVE_EVERY}'}"
    continued = parity.run(name, 1, overrides)
    assert [row["step"] for row in continued.metrics] == list(range(SAVE_EVERY + 1, PARITY_STEPS + 1))
    assert_matches(lora_reference, continued, tolerance=lora_tolerance, weights=True)


@pytest.mark.multirank
def test_exports(parity, lora_reference, tmp_path):
    """The dp2 x tp2 run's checkpoint exports W + alpha/r B A (read whole from tp and dp shards);
    its PEFT adapter (from train.save_model and export --adapter-dir alike) loaded by peft onto the
    base model gives the merged model's logits."""
    from parallel3d.cli.convert_hf import export, load_tensors, model_config, parameter_shapes, stored_adapters

    run = parity.train(LAYOUTS[0], prefix="lora-", extra=LORA)
    step_dir = run.run_dir / "checkpoints" / f"step_{PARITY_STEPS}"
    export(step_dir, tmp_path / "merged", torch.float32, adapter_dir=tmp_path / "adapter")
    cfg = model_config(step_dir)
    # The last checkpoint, whole: adapters unmerged, our names.
    state = load_tensors(step_dir, parameter_shapes(step_dir, cfg) | stored_adapters(step_dir), torch.float32)
    assert any(state[n].abs().sum() > 0 for n in state if n.endswith("lora_b"))
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    for name, weight in state.items():
        if is_adapter(name):
            continue
        a, b = (state.get(name.removesuffix(".weight") + suffix) for suffix in (".lora_a", ".lora_b"))
        want = weight if a is None else weight + 2 * b @ a
        torch.testing.assert_close(merged[families.to_hf(name, cfg)], want, rtol=1e-6, atol=1e-6)
    assert load_file(str(run.run_dir / "hf_adapter" / "adapter_model.safetensors")).keys() == \
        load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")).keys()
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"])
    _assert_peft_logits(state, cfg, run.run_dir / "hf_adapter", tmp_path)
    _assert_generation_model_has_the_adapters(step_dir, tmp_path / "merged")


def _assert_generation_model_has_the_adapters(step_dir, merged_dir) -> None:
    """parallel3d-generate, parallel3d-evaluate's lm-eval adapter: the checkpoint's model, adapters included."""
    from transformers import AutoModelForCausalLM

    from parallel3d.inference.generate import load_model

    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = load_model(step_dir)(tokens)
        theirs = AutoModelForCausalLM.from_pretrained(merged_dir).eval()(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def _assert_peft_logits(state, cfg, adapter_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    base_dir.mkdir()
    save_file({families.to_hf(n, cfg): t.contiguous() for n, t in state.items() if not is_adapter(n)},
              str(base_dir / "model.safetensors"), metadata={"format": "pt"})
    (base_dir / "config.json").write_text(json.dumps(families.hf_config(cfg, torch.float32)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir).eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        base_logits = AutoModelForCausalLM.from_pretrained(base_dir).eval()(tokens).logits
        torch.testing.assert_close(peft_model(tokens).logits, merged(tokens).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base_logits, merged(tokens).logits, atol=1e-3)  # the adapters do something


# -- What is adapted, said and exported exactly (in-process, no training) ----------------------------

def tiny(**changes) -> ModelConfig:
    """A tiny model (wide init: decisive MoE routing in both implementations) with LoRA on every target."""
    from parallel3d.config.schema import MoEConfig

    moe = changes.pop("moe", None)
    changes = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, init_std=0.2,
                   lora=LoRAConfig(rank=4, alpha=8.0)) | changes
    return ModelConfig(moe=MoEConfig(**moe) if moe else MoEConfig(), **changes)


MLA = dict(attention="mla", n_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
DEEPSEEK_MOE = dict(num_experts=4, top_k=2, expert_ffn_dim=32, shared_experts=1, router="sigmoid",
                    first_dense_layers=1)
PEFT_MODELS = {  # our model: the projections LoRA adapts there (default targets)
    "llama": (tiny(), "wq wk wv wo w1 w2 w3"),
    "qwen3_moe": (tiny(qk_norm=True, moe=dict(num_experts=4, top_k=2, expert_ffn_dim=32)),
                  "wq wk wv wo (routed experts take no adapters)"),
    "qwen3_moe_dense_blocks": (tiny(qk_norm=True, moe=dict(num_experts=4, top_k=2, expert_ffn_dim=32, every=2)),
                               "wq wk wv wo w1 w2 w3"),
    "deepseek_v3": (tiny(q_lora_rank=24, moe=DEEPSEEK_MOE, **MLA), "wq_a wq_b wkv_a wkv_b wo w1 w2 w3"),
    "deepseek_v3_no_q_lora": (tiny(moe=DEEPSEEK_MOE, **MLA), "wq wkv_a wkv_b wo w1 w2 w3"),
}


def lora_model(cfg: ModelConfig):
    """Our model with adapters, B made non-zero (as after training)."""
    from parallel3d.models import Transformer

    with torch.device("meta"):
        model = Transformer(cfg)
    apply_lora(model, cfg.lora)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


@pytest.mark.parametrize("name", PEFT_MODELS)
def test_peft_loads_exactly_the_adapted_projections(name, tmp_path):
    """The console line names exactly the adapted projections; adapter_config.json's targets make
    PEFT attach adapters to exactly those modules (not to routed experts: PEFT renames feed-forward
    names to the fused experts of transformers 5's MoE models), with our model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from parallel3d.hf.export import save_state_dict
    from parallel3d.hf.lora import split_adapters, write_adapter
    from parallel3d.models.lora import describe_targets, target_linears

    cfg, said = PEFT_MODELS[name]
    model = lora_model(cfg)
    assert describe_targets(cfg) == said
    assert {module.rsplit(".", 1)[1] for module, _ in target_linears(model, cfg.lora.targets)} == set(
        said.split(" (")[0].split())
    base, adapters = split_adapters(model.state_dict())
    save_state_dict(tmp_path / "base", base, cfg=cfg, tokenizer=None)
    write_adapter(tmp_path / "adapter", adapters, cfg, str(tmp_path / "base"))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                           tmp_path / "adapter").eval()
    attached = {n.removeprefix("base_model.model.").removesuffix(".lora_A") for n, _ in peft_model.named_modules()
                if n.endswith(".lora_A")}
    ours = {families.to_hf(n.removesuffix(".lora_a") + ".weight", cfg).removesuffix(".weight")
            for n in adapters if n.endswith("lora_a")}
    assert attached == ours
    batch = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(batch).logits, model(batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, problem", [
    (["model=tiny_moe", "model.lora.targets=[w1,w2,w3]"], "routed experts"),
    (["model.lora.targets=[wkv_a,wkv_b]"], "names no projection of this model"),
])
def test_targets_that_adapt_nothing_are_refused(overrides, problem):
    with pytest.raises(ConfigError, match=rf"^model\.lora\.targets=.*{problem}.*Fix: name some of wq wk wv wo"):
        check(compose([*LORA, *overrides]), 1)


def test_dropout_on_peft_parameters_is_refused_with_save_model():
    overrides = [*LORA, "model=tiny_mla", "model.lora.dropout=0.1", "train.save_model=true"]
    with pytest.raises(ConfigError, match=r"^model\.lora\.dropout=0\.1: PEFT adapts w1 w2 w3 of a deepseek_v3"):
        check(compose(overrides), 1)
    check(compose([*overrides, "model.lora.targets=[wq_a,wq_b,wkv_a,wkv_b,wo]"]), 1)


@pytest.mark.fast
def test_adapter_a_starts_as_peft_default():
    """A is uniform in +-1/sqrt(in) as PEFT's default (Kaiming-uniform, a=sqrt(5)) draws it: our draw
    and PEFT's have the same bound and the same distribution; B starts at zero."""
    from peft import LoraConfig, get_peft_model

    cfg = tiny(dim=512, n_layers=1, lora=LoRAConfig(rank=16, targets=["wq"]))
    a = dict(lora_model(cfg).named_parameters())["layers.0.attention.wq.lora_a"].detach().flatten()
    torch.manual_seed(0)
    theirs = get_peft_model(torch.nn.Sequential(torch.nn.Linear(512, 512)), LoraConfig(r=16, target_modules=["0"]))
    b = theirs.base_model.model[0].lora_A["default"].weight.detach().flatten()
    bound = 1 / 512 ** 0.5
    assert a.abs().max() <= bound and b.abs().max() <= bound  # a normal draw of the same std would exceed it
    assert a.abs().max() > 0.99 * bound
    quantiles = torch.linspace(0.01, 0.99, 99)
    assert (a.quantile(quantiles) - b.quantile(quantiles)).abs().max() < 0.05 * bound
