"""LoRA (Hu et al., 2021): low-rank adapters on the linear projections of a frozen model.

A targeted projection ``y = W x`` computes ``y = W x + (alpha / rank) * B A dropout(x)``, A of shape
(rank, in) and B of shape (out, rank); only the adapters train. B starts at zero, so training starts
from the base model exactly; A starts as PEFT's default initialises it (Kaiming-uniform with
a=sqrt(5): uniform in +-1/sqrt(in)), drawn from (seed, its name) like every other weight
(``models.llama.init_weights``), so its values do not depend on the layout.

Targets name projections by their last name: attention's ``wq wk wv wo`` (multi-head latent
attention's ``wq`` or ``wq_a wq_b``, and ``wkv_a wkv_b wo``), the SwiGLU's ``w1 w2 w3`` in dense
blocks and shared experts. Routed experts take no adapters. A target the model does not have adapts
nothing (``adapted_targets`` says what does: the console line and PEFT's adapter_config.json list
exactly those); targets that adapt nothing at all are refused. The adapters are
parameters of the projection they adapt (``layers.3.attention.wq.lora_a``): checkpoints save and
reshard them with the rest, and the base weight keeps its name.

They are added after tensor parallelism, split to match the base layer's split, so the adapter
needs no communication of its own:

    base layer                      A (rank x in)         B (out x rank)       adapter output
    column-parallel (wq wk wv w1 w3,  replicated            Shard(0)             Shard(-1), as W x
      MLA's wq_b wkv_b)
    row-parallel (wo w2)             Shard(1) (rows)       replicated           Partial, as W x
    replicated (MLA's wq_a wkv_a)    replicated            replicated           replicated, as W x
    not split (no tp)                plain                 plain                plain

The adapter runs in a forward hook on the projection that goes before tensor parallelism's output
hook: it sees the projection's input and output as DTensors, and the row-parallel partial sums of
``B A x`` are reduced (or reduce-scattered, under sequence parallelism) with those of ``W x``.
Everything else is frozen (``requires_grad=False``): no gradient, no optimizer state, and FSDP
reduces only the adapters' gradients.

Dropout draws its masks from each rank's generator, as any dropout does: losses then differ between
layouts (and from one process) by the masks drawn. It is refused where it would be wrong rather than
just different: under tensor parallelism (the ranks of one replicated input would draw different
masks) and with activation checkpointing (the recomputation would draw others).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.base import ConfigError, is_dtensor
from parallel3d.config.schema import LoRAConfig, ModelConfig
from parallel3d.models.moe import is_moe_layer

# Our projection names, and Hugging Face's (Llama, Qwen3, DeepSeek-V3's attention) for them.
ATTENTION_TARGETS = {"gqa": ("wq", "wk", "wv", "wo"), "mla": ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo")}
FFN_TARGETS = ("w1", "w2", "w3")
TARGETS = ("wq", "wq_a", "wq_b", "wk", "wv", "wkv_a", "wkv_b", "wo", *FFN_TARGETS)
HF_TARGETS = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "wq_a": "q_a_proj", "wq_b": "q_b_proj",
              "wkv_a": "kv_a_proj_with_mqa", "wkv_b": "kv_b_proj", "w1": "gate_proj", "w2": "down_proj",
              "w3": "up_proj"}
_FROM_HF = {hf: ours for ours, hf in HF_TARGETS.items()}
A, B = "lora_a", "lora_b"


def canonical_targets(targets) -> tuple[str, ...]:
    """``model.lora.targets`` in our names (Hugging Face names translated), each once, in order."""
    return tuple(dict.fromkeys(_FROM_HF.get(t, t) for t in targets))


def is_adapter(name: str) -> bool:
    return name.endswith((f".{A}", f".{B}"))


def adapter_bound(name: str, shape: tuple[int, ...]) -> float:
    """An adapter starts uniform in +-bound: 0 for B (the adapted model starts as the base); for A
    (rank x in) PEFT's default, Kaiming-uniform with a=sqrt(5), whose bound is 1/sqrt(in)."""
    return 0.0 if name.endswith(f".{B}") else 1.0 / math.sqrt(shape[1])


def model_projections(m: ModelConfig) -> tuple[str, ...]:
    """The projection names this model's blocks have, in ``TARGETS`` order (routed experts are not
    projections: they take no adapters)."""
    attention = ATTENTION_TARGETS[m.attention]
    if m.attention == "mla":
        attention = tuple(t for t in attention if t not in (("wq",) if m.q_lora_rank else ("wq_a", "wq_b")))
    dense = m.moe.shared_experts > 0 or any(not is_moe_layer(m, layer) for layer in range(m.n_layers))
    return tuple(t for t in TARGETS if t in attention or (dense and t in FFN_TARGETS))


def adapted_targets(m: ModelConfig) -> tuple[str, ...]:
    """The projections ``model.lora.targets`` adapts in this model, in ``TARGETS`` order."""
    wanted = set(canonical_targets(m.lora.targets))
    return tuple(t for t in model_projections(m) if t in wanted)


def describe_targets(m: ModelConfig) -> str:
    """What the console says LoRA adapts: exactly the adapted projections (and why the SwiGLU's are
    not, where they were asked for and every feed-forward is routed experts)."""
    asked = set(canonical_targets(m.lora.targets))
    routed = asked & set(FFN_TARGETS) and not set(adapted_targets(m)) & set(FFN_TARGETS)
    return " ".join(adapted_targets(m)) + (" (routed experts take no adapters)" if routed else "")


def check_lora(cfg) -> None:
    """Refuse LoRA settings that cannot run (one line naming the key and the fix)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    lora = m.lora
    if lora.rank < 0:
        raise ConfigError("model.lora.rank", lora.rank, "must be >= 0", "set 0 (off) or a rank such as 16")
    if lora.rank == 0:
        return
    if lora.alpha <= 0:
        raise ConfigError("model.lora.alpha", lora.alpha, "must be positive", "set e.g. 2 x model.lora.rank")
    if not 0 <= lora.dropout < 1:
        raise ConfigError("model.lora.dropout", lora.dropout, "a probability in [0, 1)", "set e.g. 0.05 or 0")
    if any(str(target).startswith("experts") for target in lora.targets):
        raise ConfigError("model.lora.targets", list(lora.targets), "adapters on routed experts are not "
                          "supported (shared experts get w1/w2/w3 adapters)", "remove the experts entry")
    unknown = [target for target in canonical_targets(lora.targets) if target not in TARGETS]
    if unknown or not lora.targets:
        raise ConfigError("model.lora.targets", list(lora.targets), f"unknown projection(s) {unknown}",
                          f"name some of {', '.join(TARGETS)} (or {', '.join(HF_TARGETS.values())})")
    if not adapted_targets(m):
        routed = " (its feed-forwards are routed experts, which take no adapters)" if m.moe.num_experts else ""
        raise ConfigError("model.lora.targets", list(lora.targets), f"names no projection of this model{routed}",
                          f"name some of {' '.join(model_projections(m))}")
    if t.float8 != "none":
        raise ConfigError("train.float8", t.float8, "LoRA adapts full-precision projections",
                          "set train.float8=none with model.lora.rank > 0")
    if cfg.optim.name != "adamw":  # Muon orthogonalises whole matrices; nothing says it suits rank-r adapters
        raise ConfigError("optim.name", cfg.optim.name, "LoRA's adapters train with AdamW here",
                          "set optim.name=adamw with model.lora.rank > 0")
    if lora.dropout and p.tp > 1:
        raise ConfigError("model.lora.dropout", lora.dropout, f"under parallel.tp={p.tp} the tp ranks would drop "
                          "different inputs of one replicated activation", "set model.lora.dropout=0 or parallel.tp=1")
    if lora.dropout and m.activation_checkpoint != "none":
        raise ConfigError("model.lora.dropout", lora.dropout, "activation checkpointing would recompute the "
                          "adapters with other dropout masks", "set model.lora.dropout=0 or "
                          "model.activation_checkpoint=none")


def target_linears(model: nn.Module, targets) -> list[tuple[str, nn.Linear]]:
    """The blocks' projections named in ``targets`` (dense feed-forwards and shared experts alike)."""
    wanted = set(canonical_targets(targets))
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith("layers.") and name.rsplit(".", 1)[-1] in wanted]


def apply_lora(model: nn.Module, lora: LoRAConfig) -> None:
    """Freeze ``model`` (the whole model or a pipeline stage, on meta, after tensor parallelism)
    and give each targeted projection its adapters (see the module docstring)."""
    for param in model.parameters():
        param.requires_grad_(False)
    for _, linear in target_linears(model, lora.targets):
        _add_adapter(linear, lora)


def _add_adapter(linear: nn.Linear, lora: LoRAConfig) -> None:
    weight = linear.weight
    out_features, in_features = weight.shape  # a DTensor's shape is the whole weight's
    a = torch.empty(lora.rank, in_features, device=weight.device, dtype=weight.dtype)
    b = torch.empty(out_features, lora.rank, device=weight.device, dtype=weight.dtype)
    if is_dtensor(weight):
        from torch.distributed.tensor import distribute_tensor

        a_placements, b_placements = adapter_placements(weight.placements)
        a = distribute_tensor(a, weight.device_mesh, a_placements, src_data_rank=None)
        b = distribute_tensor(b, weight.device_mesh, b_placements, src_data_rank=None)
    linear.register_parameter(A, nn.Parameter(a))
    linear.register_parameter(B, nn.Parameter(b))
    linear.lora_scale, linear.lora_dropout = lora.alpha / lora.rank, lora.dropout
    # Before tensor parallelism's output hook, which turns W x into a local tensor (see the docstring).
    linear.register_forward_hook(_add_adapter_output, prepend=True)


def adapter_placements(base: tuple) -> tuple[list, list]:
    """A's and B's placements on the tp mesh for a base weight placed as ``base``."""
    from torch.distributed.tensor import Replicate, Shard

    (placement,) = base
    if placement == Shard(0):  # column-parallel: each rank computes its output features
        return [Replicate()], [Shard(0)]
    if placement == Shard(1):  # row-parallel: each rank sums over its input features
        return [Shard(1)], [Replicate()]
    return [Replicate()], [Replicate()]


def _add_adapter_output(linear: nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    x = args[0]
    if linear.lora_dropout and linear.training:
        x = F.dropout(x, linear.lora_dropout)
    return output + linear.lora_scale * F.linear(F.linear(x, linear.lora_a), linear.lora_b)

