"""A Llama 3 style decoder: RMSNorm, RoPE (with Llama 3.1 scaling), grouped-query attention, SwiGLU.

Built on the meta device, parallelized, then materialized with ``init_weights``. Blocks live in an
``nn.ModuleDict`` keyed by layer index, so a parameter is named ``layers.7.attention.wq.weight``
whatever the layout; pipeline stages that drop blocks keep the names of the ones they hold.

Initial weights depend only on (seed, parameter name), never on how the parameter is sharded:
each parameter draws its full value from a generator seeded with its own name, and every rank
keeps the part it owns.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from parallel3d.base import is_dtensor
from parallel3d.config.schema import ModelConfig, RopeScaling, head_dim
from parallel3d.models.attention import rotary_tables, sdpa
from parallel3d.models.kv_cache import BlockCache, KVCache
from parallel3d.models.lora import adapter_bound, is_adapter
from parallel3d.models.mla import (MultiHeadLatentAttention, mla_attention_flops, mla_params, rope_attention_factor,
                                   rope_dim, yarn_frequencies)
from parallel3d.models.moe import MoE, active_ffn_params, expert_hidden, is_moe_layer
from parallel3d.models.partial import partial_local


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Rotation frequency of each channel pair; Llama 3.1 slows the low frequencies down, YaRN
    interpolates them (models/mla.py). Scaled ones in float32, as transformers computes them."""
    if scaling is not None and scaling.type == "yarn":
        return yarn_frequencies(head_dim, theta, scaling)
    if scaling is None:
        return (1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, blended)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel i with channel i + d/2 of x (b h s d) by the angles of its positions (s d/2).

    The half-split pairing of Hugging Face's Llama (GPT-NeoX style), not Meta's interleaved pairs:
    our q/k weights then are Hugging Face's as they are, and import/export is a renaming that can
    stream any shard (the interleaved convention needs a row permutation within each head).
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # Context parallelism (parallel/context.py) swaps in attention across the cp ranks, which
        # also knows the global positions of this rank's part of the sequence.
        self.attend = LocalAttention()
        # Qwen3: each query and key head RMS-normalized (over head_dim) before RoPE.
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, *, kv_cache: BlockCache | None = None) -> torch.Tensor:
        """positions (b, s): each token's RoPE position (None: 0..s-1, or under context parallelism
        the global positions of this rank's tokens); doc_ids (b, s): its document (None: one
        document). Both in q's sequence layout. kv_cache: the earlier tokens' keys and values,
        which these tokens extend and attend over (generation)."""
        # Head counts come from the tensors, not the config: under tensor parallelism a rank
        # holds only its share of the heads.
        q, k, v = (rearrange(w(x), "b s (h d) -> b h s d", d=self.head_dim) for w in (self.wq, self.wk, self.wv))
        # The whole sequence is here (sequence parallelism gathers it before attention), or this
        # context-parallel rank's part of it.
        if positions is None:
            positions = self.attend.positions(q.shape[2], q.device)
        cos, sin = rotary_tables(cos, sin, q.shape[2], positions)
        if self.q_norm is not None:
            q, k = head_norm(q, self.q_norm), head_norm(k, self.k_norm)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:  # one process: attention is LocalAttention, which takes the keys' ids too
            k, v = kv_cache.extend(k, v)
            out = self.attend(q, k, v, *kv_cache.document_ids(q.shape[2]))
            return self.wo(rearrange(out, "b h s d -> b s (h d)"))
        return self.wo(rearrange(self.attend(q, k, v, doc_ids), "b h s d -> b s (h d)"))


def head_norm(x: torch.Tensor, norm: nn.RMSNorm) -> torch.Tensor:
    """Qwen3's RMSNorm of each head of x (b h s d), as ``norm(x)``. Under tensor parallelism a rank
    holds some of the heads and the weight, replicated over tp, is used as a plain tensor: its
    gradient from this rank's heads is a partial sum, which DTensor sums over tp."""
    return F.rms_norm(x, norm.normalized_shape, partial_local(norm.weight), norm.eps)


class LocalAttention:
    """Attention over the sequence this process holds: causal, within documents when given."""

    def positions(self, seq_len: int, device) -> None:
        return None  # 0 .. seq_len - 1

    def __call__(self, q, k, v, doc_ids=None, doc_ids_k=None):
        """doc_ids_k: the keys' document ids where they are not the queries' (a KV cache's)."""
        doc_ids_k = doc_ids if doc_ids_k is None else doc_ids_k
        if v.shape[-1] == q.shape[-1]:
            return sdpa(q, k, v, doc_ids, doc_ids_k)
        # Values narrower than queries and keys (MLA): zero-padded to their width, flash kernels
        # (one head dim for q, k and v) apply, not the math one, which keeps s x s scores.
        return sdpa(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])), doc_ids, doc_ids_k)[..., :v.shape[-1]]


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def feed_forward(cfg: ModelConfig, layer: int) -> nn.Module:
    """Dense SwiGLU, or a mixture of experts (with its shared experts) where ``model.moe`` says."""
    if not is_moe_layer(cfg, layer):
        return FeedForward(cfg.dim, cfg.ffn_dim)
    shared = cfg.moe.shared_experts * expert_hidden(cfg)
    return MoE(cfg, FeedForward(cfg.dim, shared) if shared else None)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = MultiHeadLatentAttention(cfg, LocalAttention()) if cfg.attention == "mla" else Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = feed_forward(cfg, layer)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, *, kv_cache: BlockCache | None = None) -> torch.Tensor:
        # Keywords, not positional: tensor parallel plans prepare positional inputs only, and these
        # stay plain whole-sequence tensors (attention sees the whole sequence).
        x = x + self.attention(self.attention_norm(x), cos, sin, positions=positions, doc_ids=doc_ids,
                               kv_cache=kv_cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # nn.Embedding's own normal_ init, skipped on the meta device, where there are no values to
        # draw (init_weights sets them later) and where it runs through torch._refs, which imports
        # torch._dynamo: seconds of start-up on every rank of every run.
        weight = torch.empty(cfg.vocab_size, cfg.dim)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=weight)
        if not weight.is_meta:
            self.tok_embeddings.reset_parameters()
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # Tied embeddings are one parameter used twice, not two modules sharing a weight:
        # to_empty() and sharding would silently untie a shared Parameter.
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # False on pipeline stages after the first: their input is hidden states. (The last stage
        # of a tied model keeps tok_embeddings for its output projection only.)
        self.embeds_input = True
        # Not persistent: recomputed by init_weights, never read from a checkpoint.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, *, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Tokens to logits; a pipeline stage maps its input (tokens or hidden states) to its output.

        ``positions`` and ``doc_ids`` (b, s), from ``parallel3d.data.documents.document_inputs``:
        per-token RoPE positions and document ids of a packed sequence (None: 0..s-1, one
        document). Pipeline schedules hand every stage its micro batch's slice of them as keyword
        arguments, so they reach every block whichever stage holds it.

        ``kv_cache`` (generation, one process, a whole model): ``tokens`` continue the tokens it
        holds, at the positions after theirs; it then holds these too."""
        if kv_cache is not None:
            return self._forward_cached(tokens, kv_cache)
        h = self.tok_embeddings(tokens) if self.embeds_input else tokens
        for block in self.layers.values():
            h = block(h, self.rope_cos, self.rope_sin, positions=positions, doc_ids=doc_ids)
        if self.norm is None:  # not the last stage: pass hidden states on
            return h
        return self._logits(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)

    def _forward_cached(self, tokens: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        positions = kv_cache.positions(tokens.shape[1], tokens.device)
        h = self.tok_embeddings(tokens)
        for name, block in self.layers.items():
            h = block(h, self.rope_cos, self.rope_sin, positions=positions, kv_cache=kv_cache.block(name))
        kv_cache.advance(tokens.shape[1])
        return self._logits(h)

    @torch.no_grad()
    def init_rope(self) -> None:
        """The RoPE tables (buffers never saved): what a model loaded from a checkpoint needs besides its weights."""
        angles = torch.outer(
            torch.arange(self.cfg.max_seq_len, dtype=torch.float32),
            rope_frequencies(rope_dim(self.cfg), self.cfg.rope_theta, self.cfg.rope_scaling),
        )
        device = self.rope_cos.device  # every pipeline stage has the buffers, not every stage the embedding
        factor = rope_attention_factor(self.cfg)  # YaRN's attention factor (1 without it)
        self.rope_cos = (angles.cos() * factor).to(device)
        self.rope_sin = (angles.sin() * factor).to(device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Materialized (``to_empty``) parameters get their layout-independent initial values."""
        self.init_rope()
        residual_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, param in self.named_parameters():
            if is_adapter(name):  # LoRA's A and B (parallel3d/models/lora.py), uniform as PEFT's
                _init_param(param, name, seed, std=None, bound=adapter_bound(name, param.shape))
                continue
            if "norm" in name:
                std = None
            elif name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):
                std = residual_std  # GPT-2 scaling: keeps the residual stream's variance flat in depth
            else:
                std = self.cfg.init_std
            _init_param(param, name, seed, std)
        for name, buffer in self.named_buffers():
            if name.endswith("expert_bias"):  # the sigmoid router's balancing bias starts at zero
                buffer.zero_()


def _init_param(param: torch.Tensor, name: str, seed: int, std: float | None, bound: float | None = None) -> None:
    """``param``'s whole initial value: N(0, std), uniform in +-``bound`` (when given), ones (neither)."""
    if std is None and bound is None:
        full = torch.ones(param.shape, dtype=param.dtype, device=param.device)
    elif not (std or bound):
        full = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
    else:
        digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
        generator = torch.Generator(device=param.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        full = full.uniform_(-bound, bound, generator=generator) if bound else full.normal_(0, std, generator=generator)
    if is_dtensor(param):
        from torch.distributed.tensor import distribute_tensor

        # Every rank drew the same full tensor: keep the local part, no communication needed.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


def num_params(model: nn.Module) -> int:
    """Parameters of the full model (tied weights once), whatever their sharding."""
    return sum(p.numel() for p in model.parameters())


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight, plus attention scores (PaLM, appendix B).

    The embedding lookup does no matmul, so it counts only when tied to the output projection.
    """
    hd = head_dim(cfg)
    attention = cfg.dim * (cfg.n_heads + 2 * cfg.n_kv_heads) * hd + cfg.n_heads * hd * cfg.dim
    scores = 12 * cfg.n_heads * hd * seq_len
    if cfg.attention == "mla":  # its norms' weights count too, a rounding error
        attention, scores = mla_params(cfg), mla_attention_flops(cfg, seq_len)
    moe_layers = sum(is_moe_layer(cfg, i) for i in range(cfg.n_layers))
    ffn = (cfg.n_layers - moe_layers) * 3 * cfg.dim * cfg.ffn_dim + moe_layers * active_ffn_params(cfg)
    matmul_params = cfg.n_layers * attention + ffn + cfg.vocab_size * cfg.dim
    return 6 * matmul_params + cfg.n_layers * scores
