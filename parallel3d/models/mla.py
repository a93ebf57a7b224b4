"""Multi-head latent attention (DeepSeek-V2/V3, ``model.attention=mla``), and YaRN RoPE scaling.

Keys and values come from one low-rank latent per token: ``wkv_a`` projects x to ``kv_lora_rank``
latent channels (RMS-normalized, ``kv_norm``) plus ``qk_rope_head_dim`` channels of a RoPE key that
every head shares (the decoupled RoPE key); ``wkv_b`` expands the latent to each head's key without
RoPE (``qk_nope_head_dim``) and its value (``v_head_dim``). Queries are full rank (``wq``) or low
rank too (``wq_a``, ``q_norm``, ``wq_b`` when ``q_lora_rank`` > 0); each query head is its RoPE-free
part and a RoPE part. A head's key is (its own no-RoPE key, the shared RoPE key), so q/k heads have
``qk_nope_head_dim + qk_rope_head_dim`` channels and value heads ``v_head_dim``.

Parameter names follow torchtitan's DeepSeek-V3; ``parallel3d.hf.deepseek`` maps them onto Hugging
Face's. RoPE channels are rotated in interleaved pairs (DeepSeek's checkpoints, Hugging Face's
``rope_interleave``), as Hugging Face does it, so the weights stay as stored.

The softmax scale is 1/sqrt(q/k head dim), times YaRN's mscale(factor, mscale_all_dim)^2 under
YaRN scaling (DeepSeek-V3). It is folded into q, so every attention path (one process, context
parallel all-to-all and ring) keeps its standard 1/sqrt(head dim) scale.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
from torch import nn

from parallel3d.base import ConfigError
from parallel3d.config.schema import ModelConfig, RopeScaling, head_dim
from parallel3d.models.attention import rotary_tables
from parallel3d.models.kv_cache import BlockCache
from parallel3d.models.partial import partial_local

LATENT_NORM_EPS = 1e-6  # DeepSeek's latent norms use their own eps, not rms_norm_eps


ATTENTION_KINDS = ("gqa", "mla")


def check_attention(m: ModelConfig) -> None:
    """model.attention and multi-head latent attention's sizes (validation, before any process group)."""
    if m.attention not in ATTENTION_KINDS:
        raise ConfigError("model.attention", m.attention, "unknown attention", f"use one of {', '.join(ATTENTION_KINDS)}")
    if m.rope_scaling is not None and m.rope_scaling.type not in ("llama3", "yarn"):
        raise ConfigError("model.rope_scaling.type", m.rope_scaling.type, "unknown RoPE scaling", "use llama3 or yarn")
    if m.attention != "mla":
        return
    sizes = {k: getattr(m, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    bad = [k for k, v in sizes.items() if v < 1] or (["q_lora_rank"] if m.q_lora_rank < 0 else [])
    if bad:
        raise ConfigError(f"model.{bad[0]}", getattr(m, bad[0]), "must be positive (q_lora_rank: >= 0)",
                          "use a positive size")
    if m.qk_rope_head_dim % 2:
        raise ConfigError("model.qk_rope_head_dim", m.qk_rope_head_dim, "is odd and RoPE rotates pairs", "use an even size")
    if m.qk_norm:
        raise ConfigError("model.qk_norm", True, "multi-head latent attention normalizes its latents, not q/k heads",
                          "set model.qk_norm=false with model.attention=mla")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN (arXiv:2309.00071): channel pairs that turn fewer than ``beta_slow`` times over the
    original context are interpolated (frequency / factor), those over ``beta_fast`` kept, a linear
    ramp between; Hugging Face's ``_compute_yarn_parameters`` (the ramp's ends rounded out to whole
    pairs unless ``truncate`` is false), in float32 as there."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high > low else 0.001)).clamp(0, 1)
    keep = 1 - ramp
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 without YaRN, and for DeepSeek-V3's mscale = mscale_all_dim):
    the folder's ``attention_factor`` where it gives one."""
    s = cfg.rope_scaling
    if s is None or s.type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def softmax_scale(cfg: ModelConfig) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.type == "yarn" and s.mscale_all_dim:
        scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
    return scale


def rope_dim(cfg: ModelConfig) -> int:
    """Channels per head that RoPE rotates."""
    return cfg.qk_rope_head_dim if cfg.attention == "mla" else head_dim(cfg)


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the channel pairs (x0, x1), (x2, x3), ... of x (b h s d) by the angles (s d/2); the
    result de-interleaved, (rotated x0, x2, ..., rotated x1, x3, ...), Hugging Face's order."""
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attend):
        super().__init__()
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_rank, cfg.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        # One process's attention; context parallelism swaps it, as for grouped-query attention.
        self.attend = attend
        # The softmax scale relative to the attention kernels' own 1/sqrt(q/k head dim).
        self.q_scale = softmax_scale(cfg) * math.sqrt(qk_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, *, kv_cache: BlockCache | None = None) -> torch.Tensor:
        """As ``Attention.forward`` (the cache holds each head's whole key and value). Under tensor parallelism x is a replicated DTensor: the
        down-projections and their norms run whole on every tp rank, the up-projections and wo are
        split by heads (parallel/tensor.py)."""
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = rearrange(q, "b s (h d) -> b h s d", d=self.nope_dim + self.rope_dim)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = rearrange(self.wkv_b(self.kv_norm(latent)), "b s (h d) -> b h s d", d=self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = partial_local(k_rope).unsqueeze(1)  # (b, 1, s, rope): one RoPE key for all heads
        if positions is None:
            positions = self.attend.positions(q.shape[2], q.device)
        cos, sin = rotary_tables(cos, sin, q.shape[2], positions)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope, k_rope = apply_interleaved_rope(q_rope, cos, sin), apply_interleaved_rope(k_rope, cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1) * self.q_scale
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        if kv_cache is not None:  # one process: attention is LocalAttention, which takes the keys' ids too
            k, v = kv_cache.extend(k, v)
            out = self.attend(q, k, v, *kv_cache.document_ids(q.shape[2]))
            return self.wo(rearrange(out, "b h s d -> b s (h d)"))
        return self.wo(rearrange(self.attend(q, k, v, doc_ids), "b h s d -> b s (h d)"))


def mla_params(cfg: ModelConfig) -> int:
    """Weights of one multi-head latent attention layer (norms included)."""
    h, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = cfg.q_lora_rank * (cfg.dim + 1 + h * qk) if cfg.q_lora_rank else cfg.dim * h * qk
    kv = cfg.dim * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * cfg.dim


def mla_attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the scores and the weighted values (q.k over qk dims, p.v over v dims)."""
    return 6 * cfg.n_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * seq_len
