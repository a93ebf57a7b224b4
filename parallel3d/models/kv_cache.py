"""Keys and values of the tokens decoded so far, for generation one token at a time.

``Transformer.forward(tokens, kv_cache=cache)`` runs ``tokens`` as the continuation of what the
cache holds: their RoPE positions follow the cached tokens', each block's attention appends its
new keys and values to the cache and attends over all of them, and the cache then counts the new
tokens. Training never passes a cache: its path is unchanged.

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


class KVCache:
    """The cache of a whole model: one ``BlockCache`` per block, and the tokens they hold."""

    def __init__(self, *, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.blocks: dict[str, BlockCache] = {}

    def block(self, name: str) -> BlockCache:
        if name not in self.blocks:
            self.blocks[name] = BlockCache(self)
        return self.blocks[name]

    def positions(self, new_tokens: int, device: torch.device) -> torch.Tensor:
        """RoPE positions (s,) of the next ``new_tokens`` tokens."""
        return torch.arange(self.length, self.length + new_tokens, device=device)

    def advance(self, new_tokens: int) -> None:
        """Every block has stored the new tokens: count them."""
        self.length += new_tokens
