"""Hugging Face interop for the ``deepseek_v3`` family (DeepseekV3ForCausalLM): multi-head latent
attention, DeepSeek-V3's MoE (docs/mla.md).

``parallel3d.hf.families`` dispatches here for models with ``model.attention=mla``. As for the other
families our names map one to one onto Hugging Face's (stacked experts: one tensor per expert, a
view); the sigmoid router's balancing bias, a buffer, is ``e_score_correction_bias``.
"""

from __future__ import annotations

from typing import Any

from parallel3d.config.schema import ModelConfig

FAMILY = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"
MOE_PREFIX = "mlp."
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.shared.w2.weight": "mlp.shared_experts.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def block_name(rest: str) -> str:
    """A block's parameter (or the router's bias) below ``layers.N.``, Hugging Face's below ``model.layers.N.``."""
    return _BLOCK[rest]


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The family-specific part of ``config.json`` (``parallel3d.hf.families.hf_config`` adds the common keys)."""
    moe = cfg.moe
    dense_layers = cfg.n_layers if not moe.num_experts else moe.first_dense_layers
    return {
        "num_key_value_heads": cfg.n_heads,  # every head has its own key (from the shared latent)
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,
        "rope_interleave": True,
        "first_k_dense_replace": dense_layers,
        "n_routed_experts": moe.num_experts or 1,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_ffn_dim or cfg.ffn_dim,
        "n_shared_experts": moe.shared_experts,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "num_nextn_predict_layers": 0,
    }


def exportable_problem(cfg: ModelConfig) -> str | None:
    """Why DeepseekV3ForCausalLM cannot hold this model (None: it can)."""
    moe = cfg.moe
    if cfg.qk_norm or cfg.tie_embeddings:
        return "model.qk_norm and model.tie_embeddings have no DeepSeek-V3 counterpart; set them false"
    if cfg.rope_scaling is not None and cfg.rope_scaling.type != "yarn":
        return "model.rope_scaling: DeepSeek-V3 scales RoPE with yarn; set model.rope_scaling.type=yarn"
    if moe.num_experts and (moe.router != "sigmoid" or moe.every != 1 or moe.shared_experts < 1):
        return ("model.moe: DeepSeek-V3 has the sigmoid router, a MoE in every block after the first dense "
                "ones and shared experts; set router=sigmoid every=1 shared_experts>=1")
    return None
