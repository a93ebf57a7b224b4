"""Hugging Face interop: parameter names and ``config.json`` for Llama, Qwen3, Qwen3-MoE and Mixtral.

Our parameter names map one to one onto Hugging Face's, and the model uses Hugging Face's rotary
convention, so weights move between the two by renaming alone: no tensor is permuted, and any
shard of any parameter can be read or written where it lies. The one exception is a MoE block's
experts: we stack them (``experts.w1`` is (experts, hidden, dim)), Hugging Face checkpoints keep
one tensor per expert (``experts.3.gate_proj.weight``, what ``save_pretrained`` writes and hub
checkpoints hold), so an expert is a row of ours: a view, again no copy.

    family     when                            architecture          MoE block prefix, expert names
    llama      dense, no q/k norm              LlamaForCausalLM      -
    qwen3      dense, model.qk_norm            Qwen3ForCausalLM      -
    qwen3_moe  model.moe, model.qk_norm        Qwen3MoeForCausalLM   mlp.       gate_proj up_proj down_proj
    mixtral    model.moe, no q/k norm          MixtralForCausalLM    block_sparse_moe.  w1 w3 w2
    deepseek_v3  model.attention=mla           DeepseekV3ForCausalLM mlp.  (parallel3d/hf/deepseek.py)
"""

from __future__ import annotations

import torch

from parallel3d.base import is_dtensor
from parallel3d.config.schema import ModelConfig, head_dim
from parallel3d.hf import deepseek
from parallel3d.models.lora import is_adapter

_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_EXPERT_NAMES = {"qwen3_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
                 "mixtral": {"w1": "w1", "w3": "w3", "w2": "w2"}, deepseek.FAMILY: deepseek.EXPERT_NAMES}
_MOE_PREFIX = {"qwen3_moe": "mlp.", "mixtral": "block_sparse_moe.", deepseek.FAMILY: deepseek.MOE_PREFIX}
MOE_FAMILIES = tuple(_MOE_PREFIX)  # their folders may hold routed experts (DeepSeek-V3's also dense blocks only)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", deepseek.FAMILY: deepseek.ARCHITECTURE}


def family(cfg: ModelConfig | None) -> str:
    if cfg is not None and cfg.attention == "mla":
        return deepseek.FAMILY
    if cfg is None or not cfg.moe.num_experts:
        return "qwen3" if cfg is not None and cfg.qk_norm else "llama"
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


def to_hf(name: str, cfg: ModelConfig | None = None) -> str:
    """``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (not stacked experts)."""
    if name in _TOP:
        return _TOP[name]
    _, index, rest = name.split(".", 2)
    if family(cfg) == deepseek.FAMILY:
        return f"model.layers.{index}.{deepseek.block_name(rest)}"
    if rest.startswith("feed_forward.router.gate"):
        return f"model.layers.{index}.{_MOE_PREFIX[family(cfg)]}gate.weight"
    if rest.startswith("feed_forward.shared."):
        raise ValueError(f"{name}: shared experts have no counterpart in {ARCHITECTURES[family(cfg)]}")
    return f"model.layers.{index}.{_BLOCK[rest]}"


def hf_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face keys and the tensors they hold, for one of our parameters: itself renamed, or
    for stacked experts a view of each expert this rank holds (a DTensor's local rows, under
    expert or data parallelism whole experts)."""
    if ".experts.w" not in name:
        return {to_hf(name, cfg): tensor}
    first = 0
    if is_dtensor(tensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        first = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)[1][0]
        tensor = tensor.to_local()
    _, index, rest = name.split(".", 2)
    fam = family(cfg)
    prefix, weight = f"model.layers.{index}.{_MOE_PREFIX[fam]}experts", _EXPERT_NAMES[fam][rest.rsplit(".", 1)[1]]
    return {f"{prefix}.{first + e}.{weight}.weight": tensor[e] for e in range(tensor.shape[0])}


def base_hf_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``hf_tensors`` for a weight a Hugging Face folder holds; nothing for a LoRA adapter, which no
    base model has: it keeps the initialisation every LoRA run starts from (A drawn, B zero)."""
    return {} if is_adapter(name) else hf_tensors(name, tensor, cfg)


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The ``config.json`` with which ``transformers`` builds this model (see the family table)."""
    fam = family(cfg)
    config = {
        "architectures": [ARCHITECTURES[fam]],
        "model_type": fam,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": head_dim(cfg),
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling_json(cfg.rope_scaling),
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if fam == deepseek.FAMILY:
        return config | deepseek.hf_config(cfg)
    return config | _moe_config(cfg, fam)


def rope_scaling_json(s) -> dict | None:
    """``model.rope_scaling`` as transformers reads ``rope_scaling`` (every field that changes the numbers)."""
    if s is None:
        return None
    common = {"rope_type": s.type, "factor": s.factor, "original_max_position_embeddings": s.original_max_seq_len}
    if s.type == "llama3":
        return common | {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor}
    extra = {} if s.attention_factor is None else {"attention_factor": s.attention_factor}
    return common | {"beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "mscale": s.mscale,
                     "mscale_all_dim": s.mscale_all_dim, "truncate": s.truncate} | extra


def _moe_config(cfg: ModelConfig, fam: str) -> dict:
    moe, expert = cfg.moe, cfg.moe.expert_ffn_dim or cfg.ffn_dim
    if fam == "qwen3_moe":
        return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": expert,
                "decoder_sparse_step": moe.every, "mlp_only_layers": [], "norm_topk_prob": moe.norm_topk_prob,
                "router_aux_loss_coef": moe.aux_loss_coef, "use_sliding_window": False}
    if fam == "mixtral":
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "intermediate_size": expert, "router_aux_loss_coef": moe.aux_loss_coef, "sliding_window": None}
    return {"use_sliding_window": False} if fam == "qwen3" else {}


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse MoE settings no Hugging Face family here has (one line naming the key)."""
    moe, fam = cfg.moe, family(cfg)
    if fam == deepseek.FAMILY:
        problem = deepseek.exportable_problem(cfg)
        if problem:
            raise ValueError(problem)
        return
    if fam == "mixtral" and (moe.every != 1 or not moe.norm_topk_prob):
        raise ValueError("model.moe: Mixtral has a MoE in every block (every=1) and renormalized top-k weights "
                         "(norm_topk_prob=true); set them, or model.qk_norm=true for a qwen3_moe export")
    if moe.num_experts and (moe.shared_experts or moe.router != "softmax"):
        raise ValueError("model.moe: shared experts and the sigmoid router have no Qwen3-MoE or Mixtral "
                         "counterpart; export needs shared_experts=0 and router=softmax")


def exported_buffers(cfg: ModelConfig) -> bool:
    """Whether the family stores the sigmoid router's balancing bias (DeepSeek-V3 does)."""
    return family(cfg) == deepseek.FAMILY
