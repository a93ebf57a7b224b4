"""Instruction data: records rendered to samples (token ids + which of them are trained), samples
laid out in rows of ``train.seq_len + 1`` tokens.

``data.format=prompt_response`` records hold two text fields; ``chat`` records a ``messages`` list
of ``{role, content}``. Both render through the tokenizer's chat template (parallel3d/data/chat.py;
a prompt and response as a user and an assistant turn); prompt_response without a template is the
prompt's tokens, the response's tokens and EOS (each text tokenized on its own, BOS first where
the tokenizer has one). ``data.train_on=assistant`` trains the replies and their end-of-turn token,
``all`` every token.

A row is whole samples and padding: with ``data.packing`` the samples best-fit packing puts
together (parallel3d/data/packing.py), else one. A sample longer than a row is cut to its first
``seq_len + 1`` tokens (``data.truncation=truncate``) or left out (``drop``); both are counted.
Per token a flag byte says whether it is trained as a target, whether a sample (or the padding,
its own segment) starts there, and whether it is padding: the first token of a sample is never a
target, so packed samples never predict each other.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from parallel3d.data.chat import ChatTemplate, chat_ids_and_mask, load_chat_template
from parallel3d.data.packing import PACKER, best_fit_rows
from parallel3d.data.sources import DataError, Shard, missing_field_fix

TRAINED, STARTS, PADDING = 1, 2, 4  # flag bits of a token in a row
IGNORE = -100  # the target of an untrained position (cross entropy's ignore_index)


@dataclass(frozen=True)
class SFTSpec:
    """What turns records into rows: every field changes the rows (and is in the cache key)."""

    format: str
    prompt_field: str
    response_field: str
    template: ChatTemplate | None
    train_on: str
    packing: bool
    truncation: str
    seq_len: int

    @classmethod
    def from_config(cls, data_cfg, seq_len: int) -> "SFTSpec | None":
        if data_cfg.format == "text":
            return None
        template = load_chat_template(tokenizer_spec=data_cfg.tokenizer, template_file=data_cfg.chat_template)
        return cls(data_cfg.format, data_cfg.prompt_field, data_cfg.response_field, template, data_cfg.train_on,
                   data_cfg.packing, data_cfg.truncation, seq_len)

    def identity(self) -> list:
        template = self.template
        template = None if template is None else [template.source, sorted(template.special_tokens.items())]
        return [self.format, self.prompt_field, self.response_field, template, self.train_on,
                PACKER if self.packing else False, self.truncation, self.seq_len]

    @property
    def fields(self) -> list[str]:
        return ["messages"] if self.format == "chat" else [self.prompt_field, self.response_field]


@dataclass
class RowStats:
    samples: int = 0
    truncated: int = 0
    dropped: int = 0
    rows: int = 0
    sample_tokens: int = 0  # the rows' tokens that are not padding
    trained_tokens: int = 0

    def as_meta(self) -> dict:
        return {"samples": self.samples, "truncated": self.truncated, "dropped": self.dropped, "rows": self.rows,
                "sample_tokens": self.sample_tokens, "trained_tokens": self.trained_tokens}


def records(shard: Shard, fields: list[str]) -> Iterator[dict]:
    """The shard's records (only ``fields``), in order; DataError names the file and line or row."""
    if shard.kind == "text":
        raise DataError(str(shard.path), "a folder of text files holds no records",
                        "give JSON lines or parquet records, or use data.format=text")
    if shard.kind in ("parquet", "arrow"):
        yield from _table_records(shard, fields)
        return
    opener = gzip.open if shard.path.name.endswith(".gz") else open
    with opener(shard.path, "rt", encoding="utf-8") as f:
        head = f.read(64).lstrip()
        f.seek(0)
        if head.startswith("["):
            for index, record in enumerate(json.load(f)):
                yield _checked(record, fields, f"{shard.path} array index {index}")
            return
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{shard.path} line {number}", f"not valid JSON ({str(e)[:80]})",
                                    "fix or remove that line (one JSON object per line)") from None
                yield _checked(record, fields, f"{shard.path} line {number}")


def _table_records(shard: Shard, fields: list[str]) -> Iterator[dict]:
    if shard.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(shard.path)
    else:
        from datasets import Dataset

        table = Dataset.from_file(str(shard.path)).data.table
    missing = [f for f in fields if f not in table.column_names]
    if missing:
        names = ", ".join(table.column_names)[:80]
        raise DataError(f"{shard.path} row 0", f"no '{missing[0]}' field (fields: {names})",
                        missing_field_fix(table.column_names, data_format="chat" if fields == ["messages"]
                                          else "prompt_response"))
    for row, record in enumerate(table.select(fields).to_pylist()):
        yield _checked(record, fields, f"{shard.path} row {row}")


def _checked(record, fields: list[str], where: str) -> dict:
    if not isinstance(record, dict):
        raise DataError(where, f"a JSON {type(record).__name__}, not an object", "make each record one JSON object")
    for name in fields:
        value = record.get(name)
        ok = (isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in value)
              if name == "messages" else isinstance(value, str))
        if not ok:
            what = "a list of {role, content} messages" if name == "messages" else "text"
            raise DataError(where, f"'{name}' is missing or does not hold {what}", "fix that record or remove it")
    return {name: record[name] for name in fields}


def render_sample(record: dict, spec: SFTSpec, tokenizer) -> tuple[list[int], list[bool]]:
    """A record's token ids and, per token, whether it is trained (before the first-token rule)."""
    if spec.format == "chat" or spec.template is not None:
        messages = record["messages"] if spec.format == "chat" else [
            {"role": "user", "content": record[spec.prompt_field]},
            {"role": "assistant", "content": record[spec.response_field]}]
        ids, mask = chat_ids_and_mask(tokenizer=tokenizer, template=spec.template, messages=messages)
    else:
        bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        prompt = bos + tokenizer.encode(record[spec.prompt_field])
        response = tokenizer.encode(record[spec.response_field]) + [tokenizer.eos_id]
        ids, mask = prompt + response, [False] * len(prompt) + [True] * len(response)
    return ids, [True] * len(ids) if spec.train_on == "all" else mask


def sample_flags(mask: list[bool]) -> np.ndarray:
    """A sample's flag bytes: its first token starts it and is no target."""
    flags = np.asarray(mask, dtype=np.uint8) * TRAINED
    flags[0] = STARTS
    return flags


def build_rows(samples: Iterable[tuple[list[int], list[bool]]], spec: SFTSpec, pad_id: int,
               stats: RowStats) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens, flags) of each row of ``seq_len + 1`` tokens: with ``spec.packing`` the rows
    best-fit packing makes of the samples (packing.py), else one sample a row, in order."""
    width = spec.seq_len + 1
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    for ids, mask in samples:
        if not ids:
            continue
        stats.samples += 1
        if len(ids) > width:
            if spec.truncation == "drop":
                stats.dropped += 1
                continue
            stats.truncated += 1
            ids, mask = ids[:width], mask[:width]
        kept.append((np.asarray(ids, np.int64), sample_flags(mask)))
    groups = (best_fit_rows(lengths=[len(ids) for ids, _ in kept], width=width) if spec.packing
              else [[i] for i in range(len(kept))])
    for group in groups:
        yield _row([kept[i] for i in group], width, pad_id, stats)


def _row(parts: list[tuple[np.ndarray, np.ndarray]], width: int, pad_id: int, stats: RowStats
         ) -> tuple[np.ndarray, np.ndarray]:
    """One row of samples and, after them, padding: a segment of its own that no sample attends to."""
    used = sum(len(ids) for ids, _ in parts)
    pad = np.full(width - used, PADDING, np.uint8)
    if len(pad):
        pad[0] |= STARTS
    tokens = np.concatenate([*(ids for ids, _ in parts), np.full(width - used, pad_id, np.int64)])
    flags = np.concatenate([*(f for _, f in parts), pad])
    stats.rows += 1
    stats.sample_tokens += used
    stats.trained_tokens += int((flags & TRAINED).sum())
    return tokens, flags


def row_micro_batches(tokens: np.ndarray, flags: np.ndarray, micro_batch_size: int, packed: bool
                      ) -> list[tuple[torch.Tensor, ...]]:
    """Rows (n, seq_len + 1) as micro batches: (inputs, targets) with IGNORE where untrained, and
    for packed rows each input token's sample index in its row (the document ids that mask
    attention and restart positions per sample)."""
    rows = torch.from_numpy(tokens.astype(np.int64))
    bits = torch.from_numpy(flags.astype(np.int64))
    targets = rows[:, 1:].masked_fill((bits[:, 1:] & TRAINED) == 0, IGNORE)
    parts = [rows[:, :-1], targets]
    if packed:
        parts.append(((bits[:, :-1] & STARTS) != 0).long().cumsum(-1) - 1)
    return list(zip(*(p.split(micro_batch_size) for p in parts)))


def trained_targets(flags: np.ndarray) -> int:
    """Trained targets of rows (n, seq_len + 1): what the loss of their batch is divided by."""
    return int((flags[:, 1:] & TRAINED).astype(bool).sum())


def row_fill(flags: np.ndarray) -> float:
    """Sample tokens / row tokens of rows (n, seq_len + 1): how full packing left them."""
    return 1.0 - float((flags & PADDING).astype(bool).mean()) if flags.size else 0.0
