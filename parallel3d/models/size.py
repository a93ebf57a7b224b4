"""A model config's size in closed form: its parameter count without building the model.

One block of each kind (dense, mixture of experts) is built on the meta device (no memory) and
counted, then multiplied by how many blocks of that kind the config has: a count from the config
alone, in the same time for 2 layers or 10^9 (building the whole model on the meta device takes
a Python object per layer: minutes and gigabytes for a config that asks for 10^9).
"""

from __future__ import annotations

import dataclasses

import torch

from parallel3d.config.schema import ModelConfig
from parallel3d.models.llama import TransformerBlock
from parallel3d.models.moe import is_moe_layer


def moe_layer_count(cfg: ModelConfig) -> int:
    """How many of the config's blocks are MoE (models.moe.is_moe_layer, counted in closed form)."""
    moe = cfg.moe
    if moe.num_experts <= 0 or moe.every <= 0:
        return 0
    return max(0, cfg.n_layers // moe.every - moe.first_dense_layers // moe.every)


def parameter_count(cfg: ModelConfig) -> int:
    """Every parameter of the whole model ``cfg`` describes (a tied output projection counted once)."""
    moe = moe_layer_count(cfg)
    first_moe = -(-(cfg.moe.first_dense_layers + 1) // max(cfg.moe.every, 1)) * max(cfg.moe.every, 1) - 1
    kinds = [(0 if not is_moe_layer(cfg, 0) else None, cfg.n_layers - moe), (first_moe, moe)]
    total = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2) + cfg.dim  # embeddings, output, norm
    with torch.device("meta"):
        for layer, count in kinds:
            if count > 0 and layer is not None:
                total += count * sum(p.numel() for p in TransformerBlock(cfg, layer).parameters())
    return total


def with_value(cfg: ModelConfig, key: str, value) -> ModelConfig:
    """``cfg`` with the dotted model key ``key`` (``n_layers``, ``moe.num_experts``) set to ``value``."""
    section, _, name = key.rpartition(".")
    if section:
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
    return dataclasses.replace(cfg, **{name: value})
