"""RoPE from folders as transformers 5 saves them (parallel3d/config/hf_folder.py): ``rope_theta`` and
the scaling only inside ``rope_parameters``. For every family a folder saved by ``save_pretrained``
with a non-default theta, Llama 3 scaling or YaRN (its ``truncate`` and ``attention_factor`` too)
builds our model with transformers' logits (1e-5), and our config.json gives transformers the same
RoPE back; a field the model here cannot compute is refused in one line. In-process, no training."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from omegaconf import OmegaConf

from parallel3d.base import ConfigError
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.state import TrainState
from parallel3d.config.compose import compose
from parallel3d.config.schema import CheckpointConfig, ModelConfig
from parallel3d.hf import families
from parallel3d.models import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=False)
FAMILIES = {  # family: (config class, model class, its own sizes); a wide init: decisive MoE routing
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                                  moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16)),
}
YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 48}
DEEPSEEK_YARN = YARN | {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
# case: (family, rope_parameters, the field whose value the case is about: dropping it changes the logits)
CASES = {
    "llama-theta": ("llama", {"rope_type": "default", "rope_theta": 50000.0}, "rope_theta"),
    "llama-llama3": ("llama", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, "factor"),
    "qwen3-yarn": ("qwen3", YARN, "factor"),
    "qwen3-yarn-untruncated": ("qwen3", YARN | {"truncate": False}, "truncate"),
    "qwen3_moe-theta": ("qwen3_moe", {"rope_type": "default", "rope_theta": 50000.0}, "rope_theta"),
    "mixtral-theta": ("mixtral", {"rope_type": "default", "rope_theta": 50000.0}, "rope_theta"),
    "deepseek_v3-theta": ("deepseek_v3", {"rope_type": "default", "rope_theta": 50000.0}, "rope_theta"),
    "deepseek_v3-yarn-untruncated": ("deepseek_v3", DEEPSEEK_YARN | {"truncate": False}, "truncate"),
    "deepseek_v3-yarn-attention_factor": ("deepseek_v3", DEEPSEEK_YARN | {"attention_factor": 1.3}, "attention_factor"),
}


def reference(family: str, rope: dict, folder=None):
    """transformers' model of ``family`` with ``rope`` (saved to ``folder`` as save_pretrained writes it)."""
    config_class, model_class, sizes = FAMILIES[family]
    config = getattr(transformers, config_class)(**(COMMON | sizes), rope_parameters=dict(rope))
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


def ours(folder) -> tuple[Transformer, ModelConfig]:
    """Our model as ``checkpoint.init_from`` builds it: config.json alone, then the weights."""
    composed = compose([f"checkpoint.init_from={folder}"])
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), composed.model))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    Checkpointer(folder, CheckpointConfig()).load_weights(folder, TrainState([model]), cfg)
    return model.eval(), cfg


@pytest.mark.parametrize("case", CASES)
def test_transformers_5_folders_give_transformers_logits(case, tmp_path):
    family, rope, field = CASES[case]
    theirs = reference(family, rope, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    model, cfg = ours(tmp_path)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0))
    without = {k: v for k, v in rope.items() if k != field} | ({"rope_theta": 10000.0} if field == "rope_theta" else {})
    if field == "factor":  # the scaling itself
        without = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    with torch.no_grad():
        expected = theirs(tokens).logits
        assert (reference(family, without)(tokens).logits - expected).abs().max() > 1e-3, "the field changes nothing"
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)
    # Our config.json gives transformers the same RoPE back.
    config_class = getattr(transformers, FAMILIES[family][0])
    again = config_class(**{k: v for k, v in families.hf_config(cfg, torch.float32).items()
                            if k not in ("architectures", "model_type", "torch_dtype")})
    assert {k: again.rope_parameters.get(k) for k in rope} == rope


@pytest.mark.parametrize("family, rope, problem", [
    ("llama", {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, "rope type dynamic"),
    ("qwen3", YARN | {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ("deepseek_v3", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}, "rope type llama3"),
])
def test_rope_the_model_cannot_compute_is_refused(family, rope, problem, tmp_path):
    config_class, _, sizes = FAMILIES[family]
    config = getattr(transformers, config_class)(**(COMMON | sizes), rope_parameters=dict(rope))
    config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")  # never read: the refusal comes first
    with pytest.raises(ConfigError, match=rf"^checkpoint\.init_from=.*{problem}.*Fix:") as refused:
        compose([f"checkpoint.init_from={tmp_path}"])
    assert "\n" not in str(refused.value)
