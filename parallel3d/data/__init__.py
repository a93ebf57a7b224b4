"""Tokenizers, token files and the layout-invariant step sampler."""

from __future__ import annotations

from parallel3d.data.dataset import TokenFile, stdlib_token_file, text_files, write_token_file
from parallel3d.data.sampler import BatchSpec, StepSampler
from parallel3d.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def open_corpus(data_cfg) -> TokenFile:
    """The token file a DataConfig names (building the default corpus on first use)."""
    if data_cfg.source == "stdlib":
        return stdlib_token_file(load_tokenizer(data_cfg.tokenizer), data_cfg.cache_dir, data_cfg.max_bytes)
    return TokenFile(data_cfg.path)


__all__ = ["BatchSpec", "ByteTokenizer", "HFTokenizer", "StepSampler", "TokenFile", "load_tokenizer",
           "open_corpus", "stdlib_token_file", "text_files", "write_token_file"]
