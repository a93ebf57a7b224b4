"""The documents packed into a window, read off its token ids.

A window's document structure is a pure function of its tokens and the tokenizer's end-of-text
id: document k is the tokens after the k-th EOS, and an EOS belongs to the document it ends. So
nothing about documents travels with the data; whoever holds the input ids (every rank of a
data-parallel group, whatever its tensor or pipeline coordinate) derives the same ids.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from parallel3d.data.tokenizer import load_tokenizer


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(b, s) int64: the number of EOS tokens strictly before each position."""
    eos = (tokens == eos_id).long()
    return eos.cumsum(-1) - eos


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(b, s) int64: each token's offset from the first token of its document in the window."""
    index = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return index - first


@lru_cache(maxsize=8)
def eos_id_of(tokenizer: str) -> int:
    return load_tokenizer(tokenizer).eos_id


def document_inputs(tokens: torch.Tensor, data_cfg) -> dict[str, torch.Tensor]:
    """The model's keyword inputs for these input ids as ``data.document_masking`` and
    ``data.reset_positions`` say: ``doc_ids`` and/or ``positions``, or nothing."""
    if not (data_cfg.document_masking or data_cfg.reset_positions):
        return {}
    doc_ids = document_ids(tokens, eos_id_of(data_cfg.tokenizer))
    extra = {"doc_ids": doc_ids} if data_cfg.document_masking else {}
    if data_cfg.reset_positions:
        extra["positions"] = document_positions(doc_ids)
    return extra
