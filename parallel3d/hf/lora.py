"""LoRA out to Hugging Face: adapters merged into the base weights, and PEFT's adapter folder.

Both work on full tensors keyed by our parameter names, as ``parallel3d-convert-hf export`` streams
them from a checkpoint and ``train.save_model`` gathers them:

* ``merge_adapters``: ``W + alpha / rank * B @ A`` for each adapted weight (computed in float32),
  so the exported model is an ordinary one;
* ``write_adapter``: ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT writes them
  (keys ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base_model, DIR)`` loads onto the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from parallel3d.config.schema import LoRAConfig, ModelConfig
from parallel3d.hf import families
from parallel3d.models.lora import HF_TARGETS, A, B, canonical_targets, is_adapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def adapter_names(weight: str) -> tuple[str, str]:
    """``layers.0.attention.wq.weight`` -> its A and B: ``layers.0.attention.wq.lora_a``, ``...lora_b``."""
    module = weight.removesuffix(".weight")
    return f"{module}.{A}", f"{module}.{B}"


def adapted(weights, available) -> dict[str, tuple[str, str]]:
    """The weights among ``weights`` whose A and B are both in ``available`` (names), with them."""
    pairs = {weight: adapter_names(weight) for weight in weights}
    return {weight: pair for weight, pair in pairs.items() if pair[0] in available and pair[1] in available}


@torch.no_grad()
def merge_adapters(weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], lora: LoRAConfig,
                   dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``weights`` with ``alpha / rank * B @ A`` added where ``adapters`` has their A and B, each in
    ``dtype`` (None: its own); the sum is formed in float32."""
    scale, merged = lora.alpha / lora.rank, {}
    pairs = adapted(weights, adapters)
    for name, weight in weights.items():
        out = weight.float()
        if name in pairs:
            a, b = (adapters[key].float() for key in pairs[name])
            out = out + scale * (b @ a)
        merged[name] = out.to(dtype or weight.dtype)
    return merged


def split_adapters(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A whole model's state by our names -> (base weights, adapters)."""
    base = {name: t for name, t in state.items() if not is_adapter(name)}
    return base, {name: t for name, t in state.items() if is_adapter(name)}


def merged_state(state: dict[str, torch.Tensor], lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """A whole model's state (adapters included, as ``train.save_model`` gathers it) as plain weights."""
    base, adapters = split_adapters(state)
    return merge_adapters(base, adapters, lora) if adapters else base


def peft_key(name: str, cfg: ModelConfig) -> str:
    """``layers.0.attention.wq.lora_a`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    module, which = name.rsplit(".", 1)
    projection = families.to_hf(f"{module}.weight", cfg).removesuffix(".weight")
    return f"base_model.model.{projection}.lora_{'A' if which == A else 'B'}.weight"


def peft_config(cfg: ModelConfig, base_model: str | None) -> dict:
    """``adapter_config.json``: what PEFT's ``LoraConfig`` needs to rebuild the adapters."""
    lora = cfg.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(HF_TARGETS[t] for t in canonical_targets(lora.targets)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def write_adapter(out_dir: Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig,
                  base_model: str | None = None) -> None:
    """PEFT's adapter folder at ``out_dir`` from the adapters by our names (full tensors);
    ``base_model``: the Hugging Face folder or hub name they adapt, for the config's record."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(name, cfg): t.detach().cpu().contiguous() for name, t in adapters.items()}
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    (out_dir / CONFIG).write_text(json.dumps(peft_config(cfg, base_model), indent=2) + "\n")
