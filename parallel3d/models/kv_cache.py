"""Keys and values of the tokens decoded so far, for generation one token at a time.

``Transformer.forward(tokens, kv_cache=cache)`` runs ``tokens`` as the continuation of what the
cache holds: their RoPE positions follow the cached tokens', each block's attention appends its
new keys and values to the cache and attends over all of them, and the cache then counts the new
tokens. Training never passes a cache: its path is unchanged.

A batch of prompts of different lengths is left-padded (``pad``: each row's padding tokens).
Each row's positions then start at 0 at its first real token, and no real token attends to a
padding one: the padding is a document of its own (document id 0, the row's tokens 1), so the
attention mask is the one packed documents use (``models.attention.sdpa``). A row's tokens then
see exactly what they would see alone. Without padding nothing changes: the causal kernel, one
set of positions for the batch.

One process holds the whole model (``parallel3d.inference.generate``): no tensor or context parallel split.
"""

from __future__ import annotations

import torch


class BlockCache:
    """One block's keys and values (b, h_kv, max_len, d), filled up to ``cache.length``."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k, v (b, h_kv, s, d); returns the keys and values of every token so far."""
        start = self.cache.length
        end = start + k.shape[2]
        if end > self.cache.max_len:
            raise ValueError(f"the KV cache holds {self.cache.max_len} tokens; {end} do not fit")
        if self.keys is None:  # allocated on first use: the shapes (heads, head_dim, dtype) are the model's
            shape = (k.shape[0], k.shape[1], self.cache.max_len, k.shape[3])
            self.keys = k.new_empty(shape)
            self.values = v.new_empty(shape[:3] + (v.shape[3],))
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def document_ids(self, new_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The document ids of the new tokens (b, s) and of every key (b, length + s) once they are
        stored: padding 0, the row's own tokens 1; (None, None) without padding."""
        return self.cache.document_ids(new_tokens)


class KVCache:
    """The cache of a whole model: one ``BlockCache`` per block, and the tokens they hold.
    ``pad`` (b,): left-padding tokens of each row of the batch (None: none)."""

    def __init__(self, *, max_len: int, pad: torch.Tensor | None = None):
        self.max_len = max_len
        self.length = 0
        self.blocks: dict[str, BlockCache] = {}
        self.pad = pad if pad is not None and bool(pad.any()) else None

    def block(self, name: str) -> BlockCache:
        if name not in self.blocks:
            self.blocks[name] = BlockCache(self)
        return self.blocks[name]

    def positions(self, new_tokens: int, device: torch.device) -> torch.Tensor:
        """RoPE positions of the next ``new_tokens`` tokens: (s,), or (b, s) counted from each row's
        first real token (a padding token's own position is 0: what it computes is never seen)."""
        positions = torch.arange(self.length, self.length + new_tokens, device=device)
        if self.pad is None:
            return positions
        return (positions[None, :] - self.pad[:, None].to(device)).clamp(min=0)

    def document_ids(self, new_tokens: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.pad is None:
            return None, None
        end = self.length + new_tokens
        keys = (torch.arange(end, device=self.pad.device)[None, :] >= self.pad[:, None]).long()
        return keys[:, self.length:], keys

    def advance(self, new_tokens: int) -> None:
        """Every block has stored the new tokens: count them."""
        self.length += new_tokens

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows of the batch (indices), as a batch whose other rows have finished."""
        for block in self.blocks.values():
            if block.keys is not None:
                block.keys = block.keys[rows.to(block.keys.device)]
                block.values = block.values[rows.to(block.values.device)]
        if self.pad is not None:
            self.pad = self.pad[rows.to(self.pad.device)]
            self.pad = self.pad if bool(self.pad.any()) else None  # the rows left hold no padding
