"""Causal attention, optionally block-causal over the documents packed into one sequence.

``sdpa`` is the one place attention is masked: every block calls it with the document id of
each query and key token (None: the whole sequence is one document). On CPU (and wherever it is
used) the mask is a boolean (b, 1, s_q, s_k) tensor given to torch's scaled_dot_product_attention;
no GPU-specific kernel (FlexAttention, variable-length flash attention) is used, because none can
be tested on this project's CPU machines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids_q: torch.Tensor | None = None,
         doc_ids_k: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q (b, h, s_q, d) over k, v (b, h_kv, s_k, d); with document ids, a query
    sees only the earlier keys of its own document.

    doc_ids_q (b, s_q), doc_ids_k (b, s_k, default doc_ids_q). When s_q < s_k the queries are the
    last s_q positions of the keys' sequence (causality aligned at the bottom right, as a context
    parallel rank holding the tail of the keys needs it).
    """
    gqa = q.shape[1] != k.shape[1]
    s_q, s_k = q.shape[2], k.shape[2]
    if doc_ids_q is None and s_q == s_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    # (is_causal aligns causality at the top left: new tokens over a KV cache need the bottom right)
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(diagonal=s_k - s_q)
    if doc_ids_q is not None:
        doc_ids_k = doc_ids_q if doc_ids_k is None else doc_ids_k
        mask = mask & (doc_ids_q[:, None, :, None] == doc_ids_k[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, seq_len: int,
                  positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation angles' cos and sin for each token: (s, d/2) for positions 0..s-1 or for one
    set of positions (s,) shared by the batch (a context-parallel rank's), or (b, 1, s, d/2) for
    per-token positions (b, s), broadcasting over the heads."""
    if positions is None:
        return cos[:seq_len], sin[:seq_len]
    if positions.dim() == 1:
        return cos[positions], sin[positions]
    return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
