"""Context parallelism: each cp rank holds a slice of every sequence; attention spans the ranks.

Head-tail load balancing: with cp = n the sequence is cut into 2n chunks and cp rank r holds
chunks r and 2n-1-r. Under causal attention a query attends to everything before it, so the early
chunk of one rank and the late chunk of another even out: every rank does the same attention work.
Inputs and targets are cut the same way (``shard_sequence``) before the model; RoPE and the causal
mask use the global positions of a rank's tokens (``shard_positions``), derived from the cp rank
and the local length alone, so nothing extra travels through a pipeline.

Two ways to attend across the ranks (``parallel.cp_method``):

- ``alltoall`` (DeepSpeed Ulysses): q, k, v go from sequence-sharded to head-sharded by one
  all-to-all each, every rank attends over the whole sequence for 1/n of the heads (torch's SDPA,
  so exactly what one process computes), and one all-to-all brings the output back. Needs the
  heads (per tp rank) divisible by n; kv heads fewer than n (GQA) are replicated up to
  lcm(kv heads, n) first, which keeps every query head with its own kv head.
- ``ring`` (ring attention): k/v blocks pass around the cp ring, n - 1 hops; each rank merges
  the blocks' partial softmaxes by their logsumexp (online softmax). Sub-blocks that the causal
  mask hides entirely are skipped: with the head-tail layout every hop but the first computes half
  of a block. The backward recomputes each block's probabilities from the saved logsumexp, sends
  the blocks around again and sums each block's k/v gradient on its way from the next rank back to
  its owner (n - 1 hops each way: the ring minimum).

Why our own ring: torch's ``context_parallel`` (torch.distributed.tensor.experimental) runs its
ring on CUDA only; on CPU in torch 2.13 SDPA dispatches the CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``), which has no sharding strategy registered,
so a CPU-tested ring needs plain torch ops. Ours is one
autograd.Function over batch_isend_irecv. Its blocks are plain matmuls (no fused kernel): the
scores of one block exist at a time, in float32 or the compute dtype.

Document masks: ``doc_ids`` (b, s) in the layout of q. All-to-all gathers them to the whole
sequence; the ring passes each k block's ids with it. The mask is causal and same-document.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel3d.base import all_gather_single
from parallel3d.models.llama import LocalAttention

CP_METHODS = ("alltoall", "ring")


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s head-tail shard of ``x`` along ``dim``: chunks rank and 2cp-1-rank of 2cp."""
    if cp == 1:
        return x
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def shard_batch(cp_mesh: DeviceMesh | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This cp rank's shard of each (b, s) tensor of a micro batch (inputs, targets, doc ids)."""
    if cp_mesh is None:
        return tensors
    return tuple(shard_sequence(t, cp_mesh.get_local_rank(), cp_mesh.size()) for t in tensors)


def shard_positions(local_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions (local_len,) of the tokens that cp rank ``rank`` holds."""
    chunk = local_len // 2
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


local_attention = LocalAttention()  # one process's attention: what every method must equal


# ---------------------------------------------------------------------------------------------
# all-to-all (Ulysses)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 in equal splits; its gradient is the same exchange back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _seq_to_heads(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """(b, h, s, d) with this rank's s tokens -> (b, h/n, n*s, d): this rank's heads, all tokens
    (in rank order: rank 0's shard, then rank 1's ...)."""
    b, h, s, d = x.shape
    parts = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # part j goes to rank j
    got = _AllToAll.apply(parts, group)  # got[j]: rank j's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group, n: int) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``."""
    b, hn, ns, d = x.shape
    parts = x.reshape(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4)  # my heads of rank j's tokens
    got = _AllToAll.apply(parts, group)  # got[j]: rank j's heads of my tokens
    return got.transpose(0, 1).reshape(b, n * hn, ns // n, d)


def alltoall_attention(q, k, v, doc_ids, group, cp: int):
    """Ulysses: attention over the whole sequence for this rank's 1/cp of the heads."""
    s = q.shape[2]
    repeat = math.lcm(k.shape[1], cp) // k.shape[1]  # GQA: kv heads up to a multiple of cp
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    q, k, v = (_seq_to_heads(t, group, cp) for t in (q, k, v))
    # Rank order -> natural order, so SDPA's causal kernel sees the sequence as one process does.
    rank_order = torch.cat([shard_positions(s, r, cp, q.device) for r in range(cp)])
    natural = torch.argsort(rank_order)
    q, k, v = (t.index_select(2, natural) for t in (q, k, v))
    if doc_ids is not None:
        b = doc_ids.shape[0]
        gathered = doc_ids.new_empty((cp * b, s))  # rank-major, as gloo's all-gather wants it
        all_gather_single(gathered, doc_ids.contiguous(), group=group)
        doc_ids = gathered.view(cp, b, s).transpose(0, 1).reshape(b, cp * s).index_select(1, natural)
    out = local_attention(q, k, v, doc_ids).index_select(2, rank_order)
    return _heads_to_seq(out, group, cp)


# ---------------------------------------------------------------------------------------------
# ring


class _Ring:
    """This rank's place in the cp ring: blocks come from the previous rank, go to the next."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start_shift(self, x: torch.Tensor):
        """Send x to the next rank, receive the previous rank's; returns (buffer, works)."""
        buffer = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, self.next, self.group),
                                        dist.P2POp(dist.irecv, buffer, self.prev, self.group)])
        return buffer, works

    def shift(self, x: torch.Tensor) -> torch.Tensor:
        buffer, works = self.start_shift(x)
        for work in works:
            work.wait()
        return buffer


def _visible_pairs(rank: int, src: int, cp: int):
    """(q half, k half, causal) sub-blocks of q on ``rank`` x k from ``src`` that are not fully
    masked: chunk ids are (r, 2cp-1-r); a query chunk sees earlier chunks whole, its own causally."""
    q_chunks, k_chunks = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    return [(i, j, qc == kc) for i, qc in enumerate(q_chunks) for j, kc in enumerate(k_chunks) if kc <= qc]


def _scores(q, k, mask, scale):
    """q (b, hk, g, sq, d), k (b, hk, sk, d) -> masked scores (b, hk, g, sq, sk)."""
    s = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _pair_mask(causal: bool, q_doc, k_doc, c: int, device):
    mask = torch.ones(c, c, dtype=torch.bool, device=device).tril() if causal else None
    if q_doc is not None:
        same = (q_doc[:, :, None] == k_doc[:, None, :])[:, None, None]  # (b, 1, 1, sq, sk)
        mask = same if mask is None else same & mask
    return mask


def _halves(x, dim):
    return x.chunk(2, dim=dim) if x is not None else (None, None)


def _ring_forward(q, k, v, doc_ids, ring: _Ring, scale: float):
    """q (b, hk, g, s, d), k/v (b, hk, s, d) -> out like q, logsumexp (b, hk, g, s)."""
    c = q.shape[3] // 2
    q_halves, q_docs = _halves(q, 3), _halves(doc_ids, 1)
    outs, lses = [None, None], [None, None]
    kv, k_doc = torch.cat([k, v], dim=-1), doc_ids  # one message per hop; k and v may differ in width
    dk = k.shape[-1]
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        pending = []  # the next block travels while this one computes
        if step < ring.size - 1:
            pending = [ring.start_shift(t) for t in ((kv,) if k_doc is None else (kv, k_doc))]
        k_halves, v_halves, k_docs = _halves(kv[..., :dk], 2), _halves(kv[..., dk:], 2), _halves(k_doc, 1)
        for i, j, causal in _visible_pairs(ring.rank, src, ring.size):
            s = _scores(q_halves[i], k_halves[j], _pair_mask(causal, q_docs[i], k_docs[j], c, q.device), scale)
            lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - lse.masked_fill(lse == float("-inf"), 0)[..., None])  # rows with no key: 0
            out = torch.einsum("bhgqk,bhkd->bhgqd", p, v_halves[j])
            if outs[i] is None:  # every query sees itself in the first (own, diagonal) block
                outs[i], lses[i] = out, lse
            else:
                merged = torch.logaddexp(lses[i], lse)
                outs[i] = outs[i] * torch.exp(lses[i] - merged)[..., None] + out * torch.exp(lse - merged)[..., None]
                lses[i] = merged
        for _, works in pending:
            for work in works:
                work.wait()
        if pending:
            kv, k_doc = pending[0][0], pending[1][0] if k_doc is not None else None
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _ring_backward(dout, q, k, v, doc_ids, out, lse, ring: _Ring, scale: float):
    """Gradients of q, k, v. The k/v blocks go around the ring again (n - 1 hops); the gradient of
    each block is summed on its way home: it starts at the next rank (the owner keeps its own
    block's part) and reaches the owner after n - 1 hops, the minimum for a ring reduction."""
    c = q.shape[3] // 2
    delta = (dout * out).sum(-1)  # rowsum(dO * O): the softmax backward's correction
    q_h, dout_h, lse_h, delta_h = (_halves(t, 3) for t in (q, dout, lse, delta))
    q_docs = _halves(doc_ids, 1)
    dq = [torch.zeros_like(q_h[0]), torch.zeros_like(q_h[1])]
    kv, k_doc = torch.cat([k, v], dim=-1), doc_ids
    dk = k.shape[-1]
    own = torch.zeros_like(kv)  # this rank's block: its gradient stays here
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        if step == 1:
            dkv = torch.zeros_like(kv)  # the previous rank's block: its gradient starts here
        target = own if step == 0 else dkv
        k_halves, v_halves, k_docs = _halves(kv[..., :dk], 2), _halves(kv[..., dk:], 2), _halves(k_doc, 1)
        dk_halves, dv_halves = _halves(target[..., :dk], 2), _halves(target[..., dk:], 2)
        for i, j, causal in _visible_pairs(ring.rank, src, ring.size):
            s = _scores(q_h[i], k_halves[j], _pair_mask(causal, q_docs[i], k_docs[j], c, q.device), scale)
            p = torch.exp(s - lse_h[i][..., None])
            dv_halves[j].add_(torch.einsum("bhgqk,bhgqd->bhkd", p, dout_h[i]))
            dp = torch.einsum("bhgqd,bhkd->bhgqk", dout_h[i], v_halves[j])
            ds = p * (dp - delta_h[i][..., None]) * scale
            dq[i].add_(torch.einsum("bhgqk,bhkd->bhgqd", ds, k_halves[j]))
            dk_halves[j].add_(torch.einsum("bhgqk,bhgqd->bhkd", ds, q_h[i]))
        if step < ring.size - 1:
            kv = ring.shift(kv)
            if k_doc is not None:
                k_doc = ring.shift(k_doc)
        if step >= 1:
            dkv = ring.shift(dkv)  # after the last hop: this rank's own block's, from everyone else
    dkv = own + dkv
    return torch.cat(dq, dim=3), dkv[..., :dk], dkv[..., dk:]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc_ids, ring: _Ring):
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, lse = _ring_forward(q, k, v, doc_ids, ring, scale)
        ctx.save_for_backward(q, k, v, doc_ids, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, doc_ids, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, doc_ids, out, lse, ctx.ring, ctx.scale)
        return dq, dk, dv, None, None


def ring_attention(q, k, v, doc_ids, ring: _Ring):
    """q (b, h, s, d), k/v (b, hk, s, d) with this rank's head-tail shard of the sequence."""
    b, h, s, d = q.shape
    hk = k.shape[1]
    grouped = q.reshape(b, hk, h // hk, s, d)  # query head i uses kv head i // (h / hk), as SDPA's GQA
    return _RingAttention.apply(grouped, k, v, doc_ids, ring).reshape(b, h, s, v.shape[-1])


# ---------------------------------------------------------------------------------------------
# the model hook


class ContextParallelAttention:
    """What ``Attention.attend`` becomes under cp: the global positions of this rank's tokens (for
    RoPE) and attention across the cp ranks. A plain object, not a module: no parameters, no state."""

    def __init__(self, cp_mesh: DeviceMesh, method: str):
        if method not in CP_METHODS:
            raise ValueError(f"unknown cp method {method!r}: use one of {CP_METHODS}")
        self.group, self.method = cp_mesh.get_group(), method
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()
        self.ring = _Ring(self.group, self.rank, self.size) if method == "ring" else None

    def positions(self, local_len: int, device) -> torch.Tensor:
        return shard_positions(local_len, self.rank, self.size, device)

    def __call__(self, q, k, v, doc_ids=None):
        if self.method == "alltoall":
            return alltoall_attention(q, k, v, doc_ids, self.group, self.size)
        return ring_attention(q, k, v, doc_ids, self.ring)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, method: str) -> None:
    """Every attention layer of ``model`` (a whole model or a pipeline stage) attends across cp."""
    attend = ContextParallelAttention(cp_mesh, method)
    for block in model.layers.values():
        block.attention.attend = attend
