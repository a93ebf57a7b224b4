"""Tokenizers, token files and the layout-invariant step sampler."""

from __future__ import annotations

import numpy as np

from parallel3d.data.dataset import TokenFile, stdlib_token_file, text_files, write_token_file
from parallel3d.data.sampler import BatchSpec, StepSampler
from parallel3d.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def open_corpus(data_cfg) -> TokenFile:
    """The token file a DataConfig names (building the default corpus on first use)."""
    if data_cfg.source == "stdlib":
        return stdlib_token_file(load_tokenizer(data_cfg.tokenizer), data_cfg.cache_dir, data_cfg.max_bytes)
    return TokenFile(data_cfg.path)


def open_eval_corpus(data_cfg, eval_cfg) -> np.ndarray | None:
    """The held-out tokens ``eval.sources`` names (token files, concatenated in order); None when
    evaluation is off. A stand-in for the data-ingest branch's version, which also reads raw
    sources and ``eval.fraction``; its signature and result are the same."""
    if eval_cfg.fraction:
        raise ValueError("eval.fraction is not supported by this reader: list held-out token files in eval.sources")
    if not eval_cfg.sources:
        return None
    return np.concatenate([TokenFile(path).tokens for path in eval_cfg.sources])


__all__ = ["BatchSpec", "ByteTokenizer", "HFTokenizer", "StepSampler", "TokenFile", "load_tokenizer",
           "open_corpus", "open_eval_corpus", "stdlib_token_file", "text_files", "write_token_file"]
