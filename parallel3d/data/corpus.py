"""From a config to token streams: the training corpus (with its sampler) and the held-out corpus.

``data.sources`` empty keeps today's single token file (the standard library by default, or
``data.path``) and its StepSampler; otherwise each source is resolved into shards, tokenized on
first use into ``data.cache_dir`` (ranks split the shards, then wait for each other) and mixed
by ``data.weights`` through a MixtureSampler. Documents held out by ``eval.fraction`` are
never in the training stream; ``open_eval_corpus`` returns them, or ``eval.sources``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from parallel3d.base import RunError
from parallel3d.data.checks import check_rows
from parallel3d.data.dataset import TokenFile, stdlib_token_file
from parallel3d.data.integrity import prepared_file_problem
from parallel3d.data.mixture import MixtureSampler, SourceTokens
from parallel3d.data.sampler import BatchSpec, StepSampler
from parallel3d.data.sft import SFTSpec
from parallel3d.data.shards import flags_file, prepare_shards
from parallel3d.data.sources import is_token_file, resolve, source_name
from parallel3d.data.tokenizer import load_tokenizer


@dataclass
class Corpus:
    """Token streams and the ids that delimit documents: document k of a packed window is the
    tokens after its k-th EOS (the EOS ends the document it belongs to; BOS, where the tokenizer
    has one, starts each document)."""

    sources: list[SourceTokens]
    eos_id: int
    bos_id: int | None
    vocab_size: int

    @property
    def tokens(self) -> np.ndarray:
        """All tokens as one array (read into memory when there are several files: for held-out data)."""
        arrays = [a for s in self.sources for a in s.arrays]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    @property
    def flags(self) -> np.ndarray | None:
        """Instruction data: the flags of ``tokens`` (parallel3d/data/sft.py); None for text."""
        if self.sources[0].flags is None:
            return None
        arrays = [a for s in self.sources for a in s.flags]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


@dataclass(frozen=True)
class Workers:
    """Who shares the tokenization: this rank of ``world_size``, and how to wait for the others."""

    rank: int = 0
    world_size: int = 1
    barrier: Callable[[], None] | None = None


def _unique_names(paths: list[str]) -> list[str]:
    names = [source_name(p) for p in paths]
    return [n if names.count(n) == 1 else f"{n}{i}" for i, n in enumerate(names)]


def _checked_token_file(path: str, cache_dir: str) -> TokenFile:
    """A prepared token file, refused with one line when it does not match its manifest."""
    path = Path(path).expanduser()
    problem = prepared_file_problem(path, Path(cache_dir).expanduser() / "digests")
    if problem:
        raise RunError(f"{path}: {problem}. Fix: write it again with parallel3d-prepare-data")
    return TokenFile(path)


def open_sources(paths: list[str], data_cfg, heldout_fraction: float, workers: Workers = Workers(),
                 heldout: bool = False, seq_len: int = 0, key: str = "data.sources") -> Corpus:
    """The sources' token streams, tokenizing what the cache lacks. ``heldout``: the held-out
    documents instead of the training ones. ``seq_len``: the rows' length for instruction data
    (``data.format`` other than text; 0: text); an instruction source that trains no token is
    refused (checks.check_rows), naming ``key``, the config key that lists it."""
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    sft = SFTSpec.from_config(data_cfg, seq_len) if seq_len else None
    shards = [[] if is_token_file(p) else resolve(p) for p in paths]
    flat = [s for group in shards for s in group]
    files = prepare_shards(flat, tokenizer, data_cfg.text_field, heldout_fraction, data_cfg.cache_dir,
                           workers.rank, workers.world_size, workers.barrier, sft=sft) if flat else []
    sources, i = [], 0
    for name, path, group in zip(_unique_names(paths), paths, shards):
        if is_token_file(path):  # prepared ahead (parallel3d-prepare-data): all of it is what it was made for
            arrays = [] if heldout else [_checked_token_file(path, data_cfg.cache_dir).tokens]
            sources.append(SourceTokens(name, arrays))
            continue
        chosen = [f.heldout if heldout else f.train for f in files[i : i + len(group)]]
        i += len(group)
        flags = [TokenFile(flags_file(f)).tokens for f in chosen] if sft else None
        sources.append(SourceTokens(name, [TokenFile(f).tokens for f in chosen], flags))
        if sft and workers.rank == 0:
            _report_rows(name, chosen, heldout)
        if sft:  # every rank: they all stop, with the same line
            check_rows(key=key, path=path, metas=[TokenFile(f).meta for f in chosen], data_cfg=data_cfg, seq_len=seq_len)
    return Corpus(sources, tokenizer.eos_id, tokenizer.bos_id, tokenizer.vocab_size)


def _report_rows(name: str, files: list[Path], heldout: bool) -> None:
    """One console line per instruction source: samples, rows, and what did not fit a row."""
    metas = [TokenFile(f).meta for f in files]
    total = {k: sum(m[k] for m in metas) for k in ("samples", "rows", "sample_tokens", "trained_tokens",
                                                  "truncated", "dropped")}
    row_tokens = sum(m["rows"] * m["rows_of"] for m in metas)
    fill = total["sample_tokens"] / row_tokens if row_tokens else 0.0
    print(f"parallel3d: {'held-out ' if heldout else ''}{name}: {total['samples']} samples in {total['rows']} rows "
          f"(fill {fill:.1%} sample tokens), {total['trained_tokens']} trained tokens; {total['truncated']} "
          f"truncated, {total['dropped']} dropped (longer than train.seq_len + 1)", flush=True)


def open_single(data_cfg, workers: Workers = Workers()) -> Corpus:
    """Today's one token file: the standard library (rank 0 builds it, the others wait) or data.path."""
    tokenizer = load_tokenizer(data_cfg.tokenizer)
    if data_cfg.source == "stdlib":
        if workers.rank == 0:
            stdlib_token_file(tokenizer, data_cfg.cache_dir, data_cfg.max_bytes)
        if workers.barrier is not None:
            workers.barrier()
        tokens, name = stdlib_token_file(tokenizer, data_cfg.cache_dir, data_cfg.max_bytes).tokens, "stdlib"
    else:
        tokens, name = _checked_token_file(data_cfg.path, data_cfg.cache_dir).tokens, Path(data_cfg.path).stem
    return Corpus([SourceTokens(name, [tokens])], tokenizer.eos_id, tokenizer.bos_id, tokenizer.vocab_size)


def open_eval_corpus(data_cfg, eval_cfg, workers: Workers = Workers(), seq_len: int = 0) -> Corpus | None:
    """The held-out token stream: ``eval.sources``, else the ``eval.fraction`` of the training
    sources' documents that training never sees; None when neither is set."""
    if eval_cfg.sources:
        return open_sources(list(eval_cfg.sources), data_cfg, 0.0, workers, seq_len=seq_len, key="eval.sources")
    if eval_cfg.fraction > 0 and data_cfg.sources:
        return open_sources(list(data_cfg.sources), data_cfg, eval_cfg.fraction, workers, heldout=True, seq_len=seq_len)
    return None


def training_fraction(data_cfg, eval_cfg) -> float:
    """The fraction of documents held out of training (only when no separate eval.sources)."""
    return 0.0 if eval_cfg is None or eval_cfg.sources else eval_cfg.fraction


def build_train_data(data_cfg, eval_cfg, spec: BatchSpec, seed: int, offset: int = 0,
                     workers: Workers = Workers()) -> tuple[Corpus, StepSampler | MixtureSampler]:
    """The training corpus and the sampler that picks each step's windows from it."""
    if not data_cfg.sources:
        corpus = open_single(data_cfg, workers)
        return corpus, StepSampler(corpus.sources[0].arrays[0], spec, seed, offset, corpus.sources[0].name)
    corpus = open_sources(list(data_cfg.sources), data_cfg, training_fraction(data_cfg, eval_cfg), workers,
                          seq_len=spec.seq_len)
    weights = list(data_cfg.weights) if data_cfg.weights else None
    return corpus, MixtureSampler(corpus.sources, spec, seed, offset, weights, packed=data_cfg.packing)
