"""Activation memory: the bytes autograd keeps from forward to backward, per micro batch.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", eq. 2)
count ``s·b·h·(34 + 5·a·s/h)`` bytes per GPT layer. Our blocks differ, so the terms below are
counted tensor by tensor from what our forward saves (and were checked that way, see
tests/test_planner.py): grouped-query attention (k and v are ``kv_dim`` wide), SwiGLU (three
ffn-wide tensors plus the product), RMSNorm instead of LayerNorm, fused attention (no a·s²
scores: SDPA saves its output and a float32 logsumexp), and RoPE (its rotated q and k are new
tensors; the rotation itself saves only the cos/sin tables).

Notation per micro batch: T = b·s tokens, c = bytes of the compute dtype (the residual stream's
too: FSDP's mixed precision computes the whole model in it, ``parallel/data.py``), t = tp degree,
Tn = T/t with sequence parallelism (norms and residual stream split over the sequence), else T.

    RMSNorm      cuda (fused kernel): its input c·Tn·D, rstd 4·Tn
                 cpu (composite, float32 inside): float32 input 4·Tn·D and x·rstd 4·Tn·D, rstd 4·Tn
                 + its output as the next matmuls' input: c·T·D (all-gathered under sequence
                 parallelism)
    attention    rotated q c·T·D/t, rotated k and v 2·c·T·kv/t, output c·T·D/t, logsumexp 4·T·H/t,
                 the head-merging copy of the output c·T·D/t (CPU kernels, and cuDNN's attention,
                 which Hopper GPUs run, return the output heads-major)
    SwiGLU       w1 and w3 outputs, silu, product: 4·c·T·F/t
    doc. mask    with data.document_masking, SDPA keeps the additive float mask it makes of the
                 boolean one: M = c·T·s per block, whole on every tp rank (it has no head dim)
    positions    with data.reset_positions, the float32 cos and sin gathered for each token, which
                 the rotation keeps: 4·T·D/H per block

Checkpointing modes (``parallel/activation.py``):
    full         the block's input only: c·Tn·D
    selective    full on blocks whose index is a multiple of ``activation_checkpoint_every``
    op           the block's input and the outputs of every matmul and of SDPA (partial sums
                 of wo and w2 are full width before their reduce-scatter), and under tensor
                 parallelism those two reductions' outputs: c·Tn·D + c·T·(2D/t + 2kv/t + 2D
                 + 2F/t) + 4·T·H/t (+ 2·c·Tn·D when t > 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.planner.layout import Layout, ModelShape, Stage


@dataclass(frozen=True)
class Geometry:
    """Per-micro-batch sizes a rank sees."""

    tokens: int  # T = micro batch x sequence length
    tokens_norm: int  # Tn: tokens of the residual stream on this rank
    c: int  # bytes per activation element (compute dtype), the residual stream's included
    t: int  # tensor-parallel degree
    cpu: bool  # composite RMSNorm (CPU kernels); cuda: fused kernels
    mask: int = 0  # M: bytes of the attention mask a block keeps (document masking)
    token_rope: bool = False  # per-token RoPE tables (reset positions)
    sequences: int = 1  # b: sequences per micro batch
    ep: int = 1  # expert-parallel degree
    expert_cast: bool = False  # experts in no data-parallel unit cast their own weights to c

    @classmethod
    def of(cls, layout: Layout) -> "Geometry":
        tokens = layout.micro_batch_size * layout.seq_len // layout.cp  # a cp rank's part of each sequence
        split = layout.tp > 1 and layout.sequence_parallel
        mask = layout.compute_bytes * tokens * layout.seq_len if layout.document_masking else 0
        return cls(tokens, tokens // layout.tp if split else tokens, layout.compute_bytes, layout.tp,
                   layout.device == "cpu", mask, layout.reset_positions, layout.micro_batch_size, layout.ep,
                   layout.ep > 1 and layout.expert_dp == 1 and layout.compute_bytes != 4)


def norm_bytes(model: ModelShape, g: Geometry) -> int:
    """One RMSNorm and its output, saved once for the matmuls that read it."""
    D, Tn = model.dim, g.tokens_norm
    saved_inside = (4 + 4) * Tn * D if g.cpu else g.c * Tn * D
    return saved_inside + 4 * Tn + g.c * g.tokens * D


def block_bytes(model: ModelShape, g: Geometry, mode: str, moe: bool = False) -> int:
    """Bytes one transformer block keeps per micro batch under checkpointing ``mode``
    (``selective`` is resolved per block by :func:`stage_activation_bytes`); ``moe``: its
    feed-forward is a mixture of experts (:func:`moe_bytes`)."""
    D, F, kv, H, T, t, c = model.dim, model.ffn_dim, model.kv_dim, model.n_heads, g.tokens, g.t, g.c
    block_input = g.c * g.tokens_norm * D
    lse = 4 * T * H // t
    stats = moe_host_stats_bytes(model, g) if moe else 0
    if mode == "full":
        return block_input + stats
    if mode == "op":  # SAC: matmul, SDPA and tp reduction outputs kept, everything else recomputed
        reductions = c * g.tokens_norm * D if t > 1 else 0  # after wo
        attention = block_input + c * T * (2 * D // t + 2 * kv // t + D) + lse + reductions
        if model.attention == "mla":
            attention = block_input + c * T * (mla_matmul_width(model, t) + D) + lse + reductions
        if moe:
            return attention + moe_bytes(model, g, "op") + stats
        return attention + c * T * (D + 2 * F // t) + reductions
    attention = c * T * (3 * D + 2 * kv) // t + lse + g.mask + (4 * T * D // H if g.token_rope else 0)
    if model.attention == "mla":
        attention = mla_bytes(model, g) + lse + g.mask
    if moe:
        return norm_bytes(model, g) + moe_norm_bytes(model, g) + attention + moe_bytes(model, g, "none") + stats
    return 2 * norm_bytes(model, g) + attention + 4 * c * T * F // t


def mla_matmul_width(model: ModelShape, t: int) -> int:
    """Channels per token of multi-head latent attention's matmul and SDPA outputs on a tp rank:
    the replicated down-projections whole, the up-projections and SDPA's output per head."""
    H, qk = model.n_heads, model.qk_head_dim
    sdpa_out = qk if qk != model.v_head_dim else model.v_head_dim  # padded like v (``mla_bytes``)
    up = H * (qk + model.qk_nope_head_dim + model.v_head_dim + sdpa_out) // t  # wq(_b), wkv_b, SDPA output
    return model.q_lora_rank + model.kv_lora_rank + model.qk_rope_head_dim + up


def mla_bytes(model: ModelShape, g: Geometry) -> int:
    """What multi-head latent attention keeps (``models.mla``), but the logsumexp and the mask:
    the down-projections' outputs (whole on every tp rank) and their norms' (as a block's RMSNorm,
    the CPU's composite kernel keeping two float32 copies), q and k as SDPA gets them, the up-
    projected k/v (SDPA's v is a view of it) or, where v is narrower than q/k, v zero-padded to
    their width, SDPA's output (as wide as its v) and its head-merging copy; the RoPE
    part of q as its rotation saves it: the up-projected q (float32: the rotation reads views of
    it) or float32 copies of the rotated channels. Per-token RoPE tables: 4·T·rope."""
    T, t, c, H = g.tokens, g.t, g.c, model.n_heads
    qk, rope, R, Rq = model.qk_head_dim, model.qk_rope_head_dim, model.kv_lora_rank, model.q_lora_rank
    norm_inside = 8 if g.cpu else c
    latents = c * T * (R + rope) + norm_inside * T * R + c * T * R + 4 * T
    if Rq:
        latents += c * T * Rq + norm_inside * T * Rq + c * T * Rq + 4 * T
    rotated = c * T * H * qk // t if c == 4 else 4 * T * H * rope // t
    heads = c * T * H * (2 * qk + model.qk_nope_head_dim + 3 * model.v_head_dim) // t
    if qk != model.v_head_dim:  # SDPA gets v zero-padded to qk (models/llama.py LocalAttention)
        heads = c * T * H * (4 * qk + model.v_head_dim) // t
    return latents + rotated + heads + (4 * T * rope if g.token_rope else 0)


def moe_norm_bytes(model: ModelShape, g: Geometry) -> int:
    """The norm before a MoE feed-forward: the router reads this rank's tokens (its sequence shard
    under tensor parallelism), the shared experts, if any, the all-gathered sequence."""
    D, Tn = model.dim, g.tokens_norm
    saved_inside = (4 + 4) * Tn * D if g.cpu else g.c * Tn * D
    gathered = g.c * g.tokens * D if model.shared_experts and g.t > 1 else 0
    return saved_inside + 4 * Tn + g.c * Tn * D + gathered


def moe_bytes(model: ModelShape, g: Geometry, mode: str) -> int:
    """What a MoE feed-forward keeps (``models.moe.MoE.forward``), ``mode`` none or op, routing
    taken balanced (each rank computes as many token copies as it routes). Tr = tokens routed
    here (Tn), R = Tr·K copies, He the expert hidden size, Hs = shared x He.

        none   router: scores 4·Tr·E (+ the sigmoid's sum 4·Tr, with an aux loss; + renormalized
               weights 4·R and their sum 4·Tr); int64 top-k experts, sort order, token of each copy 3·8·R;
               copies in expert order, the experts' outputs and the weighted outputs 3·c·R·D;
               experts' hiddens 4·c·R·He; the weights in compute dtype c·R; the aux loss's
               per-sequence load 4·b·E. Under ep the copies arrive over an all-to-all: their
               expert order on the receiver is one more int64 8·R and the experts' outputs,
               before they go back, one more c·R·D (the sender's copies are not kept). Experts
               that cast themselves (ep with no expert_dp ranks, below float32) keep the cast:
               3·(E/ep)·He·D·c.
        op     matmul outputs: the router's logits c·Tr·E, the experts' w1 and w3 2·c·R·He and
               w2 c·R·D.
    Shared experts: a dense SwiGLU of Hs over the gathered sequence (tp-split like one), plus
    under op their w2 partial sums and reduce-scatter output.
    """
    D, E, K, He, c, t = model.dim, model.num_experts, model.top_k, model.expert_ffn_dim, g.c, g.t
    Tr, T, Hs = g.tokens_norm, g.tokens, model.shared_experts * model.expert_ffn_dim
    R = Tr * K
    if mode == "op":
        shared = c * T * (D + 2 * Hs // t) + (c * Tr * D if t > 1 else 0) if Hs else 0
        return c * Tr * E + 2 * c * R * He + c * R * D + shared
    sigmoid_sum = 4 * Tr if model.router == "sigmoid" and model.aux_loss else 0  # its scores feed the aux loss only
    router = 4 * Tr * E + sigmoid_sum + (4 * R + 4 * Tr if model.norm_topk_prob else 0)
    copies = (3 + (g.ep > 1)) * c * R * D + (3 + (g.ep > 1)) * 8 * R
    aux = 4 * g.sequences * E if model.aux_loss else 0
    cast = 3 * E // g.ep * He * D * c if g.expert_cast else 0  # the expert matmuls keep their weights
    return router + copies + 4 * c * R * He + c * R + aux + (4 * c * T * Hs // t if Hs else 0) + cast


def moe_host_stats_bytes(model: ModelShape, g: Geometry) -> int:
    """Each MoE forward's expert counts and aux loss (float64) kept for the step's metrics: host
    memory, so device memory on a CPU only."""
    return 8 * (model.num_experts + 1) if g.cpu else 0


def head_bytes(model: ModelShape, g: Geometry) -> int:
    """The last stage's final norm and loss: log_softmax keeps its float32 output, vocab-sharded
    under tensor parallelism (loss parallel); the logits themselves are not kept."""
    return norm_bytes(model, g) + 4 * g.tokens * model.vocab_size // g.t


def checkpointed(layer: int, layout: Layout) -> str:
    mode = layout.activation_checkpoint
    if mode == "selective":
        return "full" if layer % layout.activation_checkpoint_every == 0 else "none"
    return mode


def stage_activation_bytes(model: ModelShape, stage: Stage, layout: Layout) -> int:
    """Bytes one micro batch leaves alive in this stage between its forward and its backward.
    (The embedding keeps only the input tokens.) A pipeline schedule keeps each stage's output
    until the microbatch's backward: the hidden states sent on, or the last stage's logits."""
    g = Geometry.of(layout)
    total = sum(block_bytes(model, g, checkpointed(layer, layout), model.is_moe(layer)) for layer in stage.blocks)
    if stage.last:
        total += head_bytes(model, g)
        if layout.pp > 1:
            total += g.c * g.tokens * model.vocab_size // g.t
    else:
        total += g.c * g.tokens_norm * model.dim
    first_saves_copy = g.cpu and g.c != 4 and (not stage.blocks or checkpointed(stage.blocks[0], layout) == "none")
    if not stage.first and first_saves_copy:  # the received input is kept too, not only its float32 copy
        total += g.c * g.tokens_norm * model.dim
    return total


def receive_buffer_bytes(model: ModelShape, stages: list[Stage], layout: Layout, in_flight: dict[int, int]) -> int:
    """Torch's pipeline stages allocate, at their first step and for good, a buffer per microbatch
    for the hidden states they receive (stages after the first) and one for the gradients they
    receive back (stages before the last). A received input that a microbatch in flight still
    needs is that microbatch's saved stage input, already counted in its activations."""
    if layout.pp == 1:
        return 0
    g = Geometry.of(layout)
    hidden = g.c * g.tokens_norm * model.dim
    m = layout.schedule_microbatches
    return sum(((m - in_flight.get(s.index, 0)) if not s.first else 0) * hidden + (m * hidden if not s.last else 0)
               for s in stages)


def ring_scores_bytes(model: ModelShape, layout: Layout) -> int:
    """Our ring attention (``parallel/context.py``) computes each sub-block in plain ops, not a fused
    kernel: scores and probabilities of one (s/2cp)² sub-block per local head exist at once, and in
    backward two more (their gradients). Zero for the other methods: SDPA keeps a logsumexp only."""
    if layout.cp == 1 or layout.cp_method != "ring":
        return 0
    half = layout.seq_len // layout.cp // 2
    return 4 * layout.micro_batch_size * model.n_heads // layout.tp * half * half * layout.compute_bytes
