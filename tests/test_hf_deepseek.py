"""DeepSeek-V3 folders (multi-head latent attention, DeepSeek-V3's MoE) in and out: a tiny folder made
with transformers builds our model from its config.json alone, loads its weights, and gives
DeepseekV3ForCausalLM's logits; our config.json builds the same model in transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors import safe_open

from parallel3d.checkpoint.checkpointer import Checkpointer

from parallel3d.checkpoint.state import TrainState
from parallel3d.config.compose import compose
from parallel3d.config.schema import CheckpointConfig, ModelConfig
from parallel3d.hf import families
from parallel3d.models import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=12,
            qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
            max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
FOLDERS = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None}, "yarn": {"rope_parameters": YARN}}


def hf_folder(path, **changes):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**(TINY | changes))
    reference = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # a trained balancing bias, so that loading it matters
        for layer in reference.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    reference.save_pretrained(path)
    return reference


def ours(path) -> tuple[Transformer, ModelConfig]:
    """Our model as ``checkpoint.init_from`` builds it: config.json alone (no model key), then the weights."""
    composed = compose([f"checkpoint.init_from={path}"])
    assert composed.model.attention == "mla" and composed.model.name == path.name
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), composed.model))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(1)
    Checkpointer(path, CheckpointConfig()).load_weights(path, TrainState([model]), cfg)
    return model.eval(), cfg


@pytest.mark.parametrize("name", FOLDERS)
def test_logits_equal_transformers(tmp_path, name):
    reference = hf_folder(tmp_path, **FOLDERS[name])
    model, cfg = ours(tmp_path)
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(tokens).logits
        got = model(tokens)
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()
    # Export names: our parameters and the router's bias are the folder's tensors, one to one.
    ours_keys = [key for name, t in [*model.named_parameters(), *model.named_buffers()] if "rope_" not in name
                 for key in families.hf_tensors(name, t, cfg)]
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(ours_keys) == sorted(f.keys())
    # Our config.json describes the same model to transformers.
    again = transformers.DeepseekV3Config(**{k: v for k, v in families.hf_config(cfg, torch.float32).items()
                                             if k not in ("architectures", "model_type", "torch_dtype")})
    for key in ("q_lora_rank", "kv_lora_rank", "first_k_dense_replace", "n_group", "topk_group",
                "routed_scaling_factor", "num_key_value_heads", "head_dim"):
        assert getattr(again, key) == getattr(reference.config, key), key
    if name == "yarn":
        assert {k: again.rope_parameters[k] for k in YARN} == YARN


@pytest.mark.parametrize("name", ["q_lora", "yarn"])
def test_greedy_generation_equals_transformers(tmp_path, capsys, name):
    """Decoding with the KV cache (parallel3d.inference.generate) from the imported folder gives transformers'
    greedy ids; so does parallel3d-generate --token-ids on the folder."""
    from parallel3d.inference.generate import generate

    reference = hf_folder(tmp_path, **FOLDERS[name])
    model, _ = ours(tmp_path)
    prompt = [5, 17, 99, 3, 42, 7]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert generate(model, prompt, max_new_tokens=24) == expected
    if name == "q_lora":  # the command line, on the folder itself (it has no tokenizer: ids in, ids out)
        from parallel3d.cli.generate import main

        assert main([str(tmp_path), "--prompt-ids", " ".join(map(str, prompt)), "--token-ids",
                     "--max-new-tokens", "24", "--device", "cpu"]) == 0
        assert capsys.readouterr().out.split() == [str(i) for i in expected]


def test_the_folder_out_is_the_folder_in(tmp_path):
    """train.save_model's writer (hf.export.save_state_dict) writes our DeepSeek-V3 model, the router's
    balancing bias included, as a folder transformers loads with the same logits."""
    from parallel3d.hf.export import save_state_dict

    reference = hf_folder(tmp_path / "in", **FOLDERS["q_lora"])
    model, cfg = ours(tmp_path / "in")
    save_state_dict(tmp_path / "out", model.state_dict(), cfg=cfg, tokenizer=None)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, reference(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("field, value", [("quantization_config", {"quant_method": "fp8"}), ("rope_interleave", False)])
def test_weights_or_rope_the_model_cannot_read_are_refused(tmp_path, field, value):
    from parallel3d.base import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", **TINY, field: value}))
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the refusal comes first
    with pytest.raises(ConfigError, match=f"checkpoint.init_from=.*{'quantized' if field[0] == 'q' else field}"):
        compose([f"checkpoint.init_from={tmp_path}"])



def suggested(message: str) -> list[int]:
    """The values a refusal's "Fix: ... one of 1, 2." offers."""
    return [int(v) for v in message.rsplit("one of ", 1)[1].rstrip(".").split(", ")]


@pytest.mark.parametrize("key, overrides", [
    ("n_group", ["model.moe.num_experts=6"]),  # 4 groups do not divide 6 experts
    ("n_group", ["model.moe.num_experts=4"]),  # groups of one expert
    ("topk_group", ["model.moe.topk_group=5"]),  # more groups than there are
])
def test_group_fix_hints_are_accepted(key, overrides):
    """Every value the group-limited routing's refusal offers is one the next run accepts."""
    from parallel3d.base import ConfigError
    from parallel3d.validate import check

    base = ["model=tiny_mla", *overrides]
    with pytest.raises(ConfigError, match=rf"^model\.moe\.{key}=.*Fix: set model\.moe\.{key} to one of") as refused:
        check(compose(base), 1)
    for value in suggested(str(refused.value)):
        check(compose([*base, f"model.moe.{key}={value}"]), 1)


def test_a_folders_group_refusal_names_its_config_json(tmp_path):
    """From a folder, setting model.moe.n_group would only disagree with it: the refusal names the
    folder's config.json field, and each value it offers, written there, is accepted."""
    from parallel3d.base import ConfigError
    from parallel3d.validate import check

    config = {"model_type": "deepseek_v3", **TINY, "n_routed_experts": 4, "vocab_size": 512}  # byte tokens
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"")  # validation reads no weight
    with pytest.raises(ConfigError, match=r"^checkpoint\.init_from=.*: its config\.json has n_group=4: .* Fix: in "
                                          r".*config\.json, set n_group to one of") as refused:
        check(compose([f"checkpoint.init_from={tmp_path}"]), 1)
    for value in suggested(str(refused.value)):
        (tmp_path / "config.json").write_text(json.dumps(config | {"n_group": value}))
        check(compose([f"checkpoint.init_from={tmp_path}"]), 1)
