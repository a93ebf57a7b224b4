"""LoRA out to Hugging Face: adapters merged into the base weights, and PEFT's adapter folder.

Both work on full tensors keyed by our parameter names, as ``parallel3d-convert-hf export`` streams
them from a checkpoint and ``train.save_model`` gathers them:

* ``merge_adapters``: ``W + alpha / rank * B @ A`` for each adapted weight (computed in float32),
  so the exported model is an ordinary one;
* ``write_adapter``: ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT writes them
  (keys ``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight``), which
  ``peft.PeftModel.from_pretrained(base_model, DIR)`` loads onto the base model: its targets
  resolve to exactly the adapted projections (``peft_targets``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from parallel3d.base import ConfigError
from parallel3d.config.schema import LoRAConfig, ModelConfig
from parallel3d.hf import families
from parallel3d.models.lora import FFN_TARGETS, A, B, adapted_targets, is_adapter

CONFIG, WEIGHTS, ADAPTER_DIR = "adapter_config.json", "adapter_model.safetensors", "hf_adapter"


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


def peft_targets(modules, cfg: ModelConfig) -> tuple[list[str], list[str]]:
    """PEFT's ``target_modules`` and ``target_parameters`` that resolve to exactly ``modules`` (our
    names of the adapted projections, ``layers.0.attention.wq``) in transformers 5's model. A
    projection is named by its last name (``q_proj``): targets adapt a name in every block that has
    it. In a MoE family PEFT turns feed-forward names (``gate_proj``, ``w1``) into the routed experts'
    fused parameters (its transformers 5 conversion), so there a dense block's or shared expert's
    projection is named as a parameter by its path below the block: ``mlp.shared_experts.gate_proj.weight``
    (PEFT matches the end of the name; an adapter on a Linear's weight is LoRA on that Linear)."""
    by_name, by_parameter = set(), set()
    moe_family = families.family(cfg) in families.MOE_FAMILIES
    for module in modules:
        below = families.to_hf(f"{module}.weight", cfg).split(".", 3)[3]  # model.layers.N.<below>
        if moe_family and below.startswith("mlp."):
            by_parameter.add(below)
        else:
            by_name.add(below.removesuffix(".weight").rsplit(".", 1)[-1])
    return sorted(by_name), sorted(by_parameter)


def peft_problem(cfg: ModelConfig) -> str | None:
    """Why no PEFT adapter can be written for this LoRA model (None: it can), fix included."""
    try:
        families.check_exportable(cfg)
    except ValueError as e:
        return f"no Hugging Face family holds this model ({e})"
    refused = _dropout_refusal(cfg)
    return None if refused is None else str(refused)


def _dropout_refusal(m: ModelConfig) -> ConfigError | None:
    """PEFT refuses dropout on an adapter it attaches to a parameter (``peft_targets``)."""
    ffn = [t for t in adapted_targets(m) if t in FFN_TARGETS]
    if not (ffn and m.lora.dropout and families.family(m) in families.MOE_FAMILIES):
        return None
    return ConfigError("model.lora.dropout", m.lora.dropout, f"PEFT adapts {' '.join(ffn)} of a {families.family(m)} "
                       "model as parameters, which take no dropout", f"set model.lora.dropout=0, or leave "
                       f"{' '.join(ffn)} out of model.lora.targets")


def check_adapter_export(cfg) -> None:
    """Validation: a LoRA run with train.save_model=true must end with an adapter PEFT loads."""
    if cfg.model.lora.rank and cfg.train.save_model:
        refused = _dropout_refusal(cfg.model)
        if refused is not None:
            raise refused


def peft_config(cfg: ModelConfig, base_model: str | None, modules) -> dict:
    """``adapter_config.json``: what PEFT's ``LoraConfig`` needs to rebuild the adapters on ``modules``."""
    lora = cfg.lora
    by_name, by_parameter = peft_targets(modules, cfg)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": by_name,
        **({"target_parameters": by_parameter} if by_parameter else {}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def write_adapter(out_dir: Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig,
                  base_model: str | None = None) -> None:
    """PEFT's adapter folder at ``out_dir`` from the adapters by our names (full tensors);
    ``base_model``: the Hugging Face folder or hub name they adapt, for the config's record.
    Raises ValueError (one line, the fix in it) where PEFT could not load it (``peft_problem``)."""
    problem = peft_problem(cfg)
    if problem:
        raise ValueError(f"no PEFT adapter: {problem}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {peft_key(name, cfg): t.detach().cpu().contiguous() for name, t in adapters.items()}
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})
    modules = sorted({name.rsplit(".", 1)[0] for name in adapters})
    (out_dir / CONFIG).write_text(json.dumps(peft_config(cfg, base_model, modules), indent=2) + "\n")


def save_run_adapter(run_dir: Path, adapters: dict[str, torch.Tensor], cfg: ModelConfig,
                     base_model: str | None) -> str:
    """train.save_model with LoRA: the PEFT adapter at ``run_dir/hf_adapter/``, or where PEFT could
    not load one, nothing. Returns the console line saying which."""
    try:
        write_adapter(run_dir / ADAPTER_DIR, adapters, cfg, base_model)
    except ValueError as e:
        return f"parallel3d: {e}"
    return f"parallel3d: PEFT adapter written to {run_dir / ADAPTER_DIR}"
