"""Hugging Face Llama interop: parameter names and ``config.json``.

Our parameter names map one to one onto ``LlamaForCausalLM``'s, and the model uses Hugging Face's
rotary convention, so weights move between the two by renaming alone: no tensor is permuted, and
any shard of any parameter can be read or written where it lies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from parallel3d.config import ModelConfig
from parallel3d.base import ConfigError

_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}


def to_hf(name: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    if name in _TOP:
        return _TOP[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{_BLOCK[rest]}"


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """The ``config.json`` with which ``transformers`` builds this model as ``LlamaForCausalLM``."""
    scaling = cfg.rope_scaling
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        },
        "max_position_embeddings": cfg.max_seq_len,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def check_shapes(path: Path, cfg: ModelConfig) -> None:
    """Refuse Hugging Face weights of another shape before any tensor is read, naming the key.

    The checkpoint section of validation calls it before any process starts."""
    hf = json.loads((path / "config.json").read_text())
    expected = {"hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
                "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
                "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings}
    ours = {"hidden_size": "dim", "intermediate_size": "ffn_dim", "num_hidden_layers": "n_layers",
            "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "vocab_size": "vocab_size",
            "tie_word_embeddings": "tie_embeddings"}
    for key, value in expected.items():
        theirs = hf.get(key, value if key != "num_key_value_heads" else hf.get("num_attention_heads"))
        if theirs != value:
            raise ConfigError("checkpoint.init_from", path, f"its config.json has {key}={theirs} but "
                              f"model.{ours[key]}={value}", f"set model.{ours[key]}={theirs} (or pick the "
                              f"matching model config)")
