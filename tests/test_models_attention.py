"""Document masking and per-document positions: a packed sequence computes what its documents
compute alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from parallel3d.config.compose import compose
from parallel3d.config.schema import DataConfig, ModelConfig
from parallel3d.data.documents import document_ids, document_inputs, document_positions
from parallel3d.models.attention import sdpa
from parallel3d.models.llama import Transformer

EOS = 256
LENGTHS = [5, 9, 1, 7]  # documents of one packed window (the last one cut off, no EOS)


def packed_tokens(lengths: list[int], seed: int = 0) -> torch.Tensor:
    """(1, sum(lengths)): documents of random bytes, each but the last ended by EOS."""
    generator = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 256, (n,), generator=generator) for n in lengths]
    for doc in docs[:-1]:
        doc[-1] = EOS
    return torch.cat(docs)[None]


def test_document_ids_and_positions():
    tokens = torch.tensor([[7, EOS, 3, 4, EOS, EOS, 9], [EOS, 1, 2, 3, 4, 5, 6]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert document_positions(ids).tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_document_inputs_follow_the_data_config():
    tokens = packed_tokens(LENGTHS)
    assert document_inputs(tokens, DataConfig()) == {}
    masked = document_inputs(tokens, DataConfig(document_masking=True))
    assert set(masked) == {"doc_ids"} and masked["doc_ids"].max() == len(LENGTHS) - 1
    both = document_inputs(tokens, DataConfig(document_masking=True, reset_positions=True))
    assert set(both) == {"doc_ids", "positions"} and both["positions"][0, LENGTHS[0]] == 0


@pytest.mark.fast
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_masked_attention_equals_each_document_alone(kv_heads):
    torch.manual_seed(0)
    doc_ids = document_ids(packed_tokens(LENGTHS), EOS)
    s = doc_ids.shape[1]
    q, k, v = torch.randn(1, 4, s, 8), torch.randn(1, kv_heads, s, 8), torch.randn(1, kv_heads, s, 8)
    packed = sdpa(q, k, v, doc_ids, doc_ids)
    start = 0
    for n in LENGTHS:
        part = slice(start, start + n)
        alone = sdpa(q[:, :, part], k[:, :, part], v[:, :, part])
        torch.testing.assert_close(packed[:, :, part], alone)
        start += n
    # Without document ids it is plain causal attention over the whole window (and differs).
    torch.testing.assert_close(sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                             enable_gqa=kv_heads != 4))
    assert not torch.allclose(sdpa(q, k, v), packed)


def test_masked_attention_with_queries_at_the_end_of_the_keys():
    """s_q < s_k: the queries are the last positions (a context-parallel rank's tail)."""
    torch.manual_seed(1)
    doc_ids = document_ids(packed_tokens(LENGTHS), EOS)
    q, k, v = (torch.randn(2, 4, doc_ids.shape[1], 8) for _ in range(3))
    doc_ids = doc_ids.expand(2, -1)
    full = sdpa(q, k, v, doc_ids, doc_ids)
    tail = sdpa(q[:, :, -6:], k, v, doc_ids[:, -6:], doc_ids)
    torch.testing.assert_close(tail, full[:, :, -6:])


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    cfg = OmegaConf.to_object(compose(["model=tiny"]).model)
    assert isinstance(cfg, ModelConfig)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def document_logits(model: Transformer, tokens: torch.Tensor, reset_positions: bool) -> list[torch.Tensor]:
    extra = document_inputs(tokens, DataConfig(document_masking=True, reset_positions=reset_positions))
    logits = model(tokens, **extra)
    return list(logits.split(LENGTHS, dim=1))


@torch.no_grad()
def test_reset_positions_equal_per_document_runs(tiny):
    tokens = packed_tokens(LENGTHS, seed=2)
    for doc, packed in zip(tokens.split(LENGTHS, dim=1), document_logits(tiny, tokens, reset_positions=True)):
        torch.testing.assert_close(packed, tiny(doc))


@torch.no_grad()
def test_masking_alone_keeps_window_positions(tiny):
    """Masked but not reset: a document computes what it computes alone at its window offsets."""
    tokens = packed_tokens(LENGTHS, seed=3)
    start = 0
    for doc, packed in zip(tokens.split(LENGTHS, dim=1), document_logits(tiny, tokens, reset_positions=False)):
        n = doc.shape[1]
        positions = torch.arange(start, start + n)[None]
        torch.testing.assert_close(packed, tiny(doc, positions=positions))
        start += n


@torch.no_grad()
def test_reset_positions_without_masking_change_cross_document_attention(tiny):
    """RoPE sees relative positions only, so within a document resetting changes nothing (above);
    where attention crosses documents it does."""
    tokens = packed_tokens(LENGTHS, seed=5)
    reset = tiny(tokens, **document_inputs(tokens, DataConfig(reset_positions=True)))
    first = LENGTHS[0]
    torch.testing.assert_close(reset[:, :first], tiny(tokens)[:, :first])
    assert not torch.allclose(reset[:, first:], tiny(tokens)[:, first:], atol=1e-4)


@torch.no_grad()
def test_positions_default_to_the_window_order(tiny):
    tokens = packed_tokens(LENGTHS, seed=4)
    positions = torch.arange(tokens.shape[1])[None]
    torch.testing.assert_close(tiny(tokens, positions=positions), tiny(tokens))
