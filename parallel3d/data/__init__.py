"""Sources, tokenizers, token files, the tokenization cache and the layout-invariant samplers."""

from __future__ import annotations

from parallel3d.data.corpus import Corpus, Workers, build_train_data, open_eval_corpus, open_sources
from parallel3d.data.dataset import TokenFile, stdlib_token_file, text_files, write_token_file
from parallel3d.data.loader import Prefetcher
from parallel3d.data.mixture import MixtureSampler, SourceTokens
from parallel3d.data.sampler import BatchSpec, StepSampler
from parallel3d.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer


def open_corpus(data_cfg) -> TokenFile:
    """The token file a DataConfig names (building the default corpus on first use)."""
    if data_cfg.source == "stdlib":
        return stdlib_token_file(load_tokenizer(data_cfg.tokenizer), data_cfg.cache_dir, data_cfg.max_bytes)
    return TokenFile(data_cfg.path)


__all__ = ["BatchSpec", "ByteTokenizer", "Corpus", "HFTokenizer", "MixtureSampler", "Prefetcher", "SourceTokens",
           "StepSampler", "TokenFile", "Workers", "build_train_data", "load_tokenizer", "open_corpus",
           "open_eval_corpus", "open_sources", "stdlib_token_file", "text_files", "write_token_file"]
