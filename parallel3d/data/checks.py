"""What can be known about the data before any process group: called by validate.check().

Every source must resolve to non-empty files whose headers read (a corrupt parquet footer, a
saved dataset without the text column, a JSON-lines file whose first record lacks the field),
``data.weights`` must match the sources, ``eval.*`` must make sense, and a prepared token file
must fit the model's vocabulary. Problems deeper in a file (line 90,000 without the text field)
surface when that shard is tokenized, with the same one-line error naming file and line.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from parallel3d.base import ConfigError, RunError
from parallel3d.data.chat import assistant_spans, has_generation_blocks, load_chat_template
from parallel3d.data.sft import PADDING, STARTS, records
from parallel3d.data.sources import DataError, Shard, is_token_file, missing_field_fix, resolve


def check_data(cfg) -> None:
    d, e = cfg.data, cfg.eval
    _check_init_from_tokenizer(cfg)
    check_instruction_data(d)
    fields = {"text": [d.text_field], "chat": ["messages"]}.get(d.format, [d.prompt_field, d.response_field])
    for key, paths in (("data.sources", d.sources), ("eval.sources", e.sources)):
        for path in paths:
            if is_token_file(path):
                if d.format != "text":
                    raise ConfigError(key, path, f"a token file holds no records for data.format={d.format}",
                                      "give the JSON lines or parquet records themselves")
                _check_token_file(Path(path).expanduser(), cfg.model.vocab_size, key)
                continue
            try:
                for shard in resolve(path):
                    for name in fields:
                        _check_header(shard, name, d.format)
            except DataError as e:  # named by the key that lists the file
                raise ConfigError(key, e.where, e.problem, e.fix) from None
    if d.weights is not None:
        if not d.sources:
            raise ConfigError("data.weights", list(d.weights), "weights without data.sources",
                              "list the files to mix in data.sources, or drop data.weights")
        if len(d.weights) != len(d.sources):
            raise ConfigError("data.weights", list(d.weights), f"{len(d.weights)} weights for "
                              f"{len(d.sources)} data.sources", "give one weight per source, in the same order")
        if any(w < 0 for w in d.weights) or sum(d.weights) <= 0:
            raise ConfigError("data.weights", list(d.weights), "weights must be >= 0 and not all 0",
                              "use positive weights (they are normalized to sum to 1)")
    if not 0 <= e.fraction < 1:
        raise ConfigError("eval.fraction", e.fraction, "must lie in [0, 1)", "use e.g. 0.01")
    if e.fraction > 0 and not d.sources and not e.sources:
        raise ConfigError("eval.fraction", e.fraction, "documents are held out of data.sources, which is empty",
                          "set data.sources, or give held-out files in eval.sources")
    if e.fraction > 0 and not e.sources and all(is_token_file(p) for p in d.sources):
        raise ConfigError("eval.fraction", e.fraction, "token files are taken whole: no documents to hold out",
                          "give held-out files in eval.sources")
    if e.every < 0 or e.batches < 1:
        raise ConfigError("eval.every" if e.every < 0 else "eval.batches", e.every if e.every < 0 else e.batches,
                          "eval.every must be >= 0 and eval.batches >= 1", "use e.g. eval.every=100 eval.batches=4")
    if not d.sources and d.source == "file" and d.path and Path(d.path).expanduser().is_file():
        _check_token_file(Path(d.path).expanduser(), cfg.model.vocab_size)


def _check_init_from_tokenizer(cfg) -> None:
    """Instruction data whose tokenizer was to come from ``checkpoint.init_from`` but did not (a
    mistyped path leaves the byte tokenizer): the folder is named, not the tokenizer it left."""
    init_from, d = cfg.checkpoint.init_from, cfg.data
    if not init_from or d.format == "text" or d.tokenizer != "byte":
        return
    path = Path(str(init_from)).expanduser()
    if not path.exists():
        raise ConfigError("checkpoint.init_from", init_from, "no such file or folder", "check the path (a Hugging "
                          "Face folder: config.json, *.safetensors and its tokenizer files)")
    is_hf = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    if is_hf:
        raise ConfigError("checkpoint.init_from", init_from, "the folder has no tokenizer.json, so the run would "
                          "use the byte tokenizer", "copy the model's tokenizer files into it, or set "
                          "data.tokenizer=TOKENIZER_DIR")
    ours = (path / "COMPLETE").is_file() or (path / "checkpoints").is_dir() or any(path.glob("step_*/COMPLETE"))
    if not ours:
        raise ConfigError("checkpoint.init_from", init_from, "not a Hugging Face folder (config.json + "
                          "*.safetensors) nor a checkpoint", "check the path")


def check_instruction_data(d) -> None:
    """data.format and its keys (parallel3d/data/sft.py): a chat needs a tokenizer with a template."""
    for key, value, allowed in (("data.format", d.format, ("text", "prompt_response", "chat")),
                                ("data.train_on", d.train_on, ("assistant", "all")),
                                ("data.truncation", d.truncation, ("truncate", "drop"))):
        if value not in allowed:
            raise ConfigError(key, value, "unknown value", f"use one of {', '.join(allowed)}")
    if d.format == "text":
        return
    if not d.sources:
        raise ConfigError("data.format", d.format, "instruction records are read from data.sources, which is empty",
                          "list the JSON lines or parquet files in data.sources")
    if d.chat_template and not Path(d.chat_template).expanduser().is_file():
        raise ConfigError("data.chat_template", d.chat_template, "no such file", "give a Jinja template file")
    if d.format == "chat" and d.tokenizer == "byte" and not d.chat_template:
        raise ConfigError("data.format", "chat", "the byte tokenizer has no chat template",
                          "set data.tokenizer to a Hugging Face tokenizer folder (or checkpoint.init_from), "
                          "or data.chat_template=FILE")
    template = load_chat_template(tokenizer_spec=d.tokenizer, template_file=d.chat_template)
    if d.format == "chat" and template is None:
        raise ConfigError("data.format", "chat", f"{d.tokenizer} has no chat template (chat_template.jinja or "
                          "tokenizer_config.json's chat_template)", "set data.chat_template=FILE")
    if template is not None:
        try:
            assistant_spans(template=template, messages=[{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": "hello"}])
        except Exception as e:  # a template that does not render, or whose turns cannot be found
            raise ConfigError("data.chat_template", template.origin, f"does not render a chat "
                              f"({str(e).splitlines()[0][:100]})", "fix the template or give another") from None


def _check_token_file(path: Path, model_vocab: int, key: str = "data.path") -> None:
    meta_path = path.with_suffix(".json")
    if not meta_path.is_file():
        raise ConfigError(key, path, f"{meta_path.name} is missing beside it",
                          "write token files with parallel3d-prepare-data (it writes both)")
    vocab = json.loads(meta_path.read_text())["vocab_size"]
    if vocab > model_vocab:
        raise ConfigError(key, path, f"its tokens come from a vocabulary of {vocab}, larger than "
                          f"model.vocab_size={model_vocab}", f"use model.vocab_size >= {vocab}")


def _check_header(shard: Shard, text_field: str, data_format: str = "text") -> None:
    """The cheap part of reading: metadata and the first record."""
    import pyarrow as pa

    names: list[str] | None = None
    try:
        if shard.kind == "parquet":
            import pyarrow.parquet as pq

            names = pq.ParquetFile(shard.path).schema_arrow.names
        elif shard.kind == "arrow":
            from datasets import Dataset

            names = list(Dataset.from_file(str(shard.path)).column_names)
        elif shard.kind == "json":
            names = _first_json_record_fields(shard)
    except (pa.ArrowInvalid, OSError, ValueError) as err:
        raise DataError(str(shard.path), f"cannot be read ({str(err).splitlines()[0][:120]})",
                        "rewrite or remove this file (is it truncated or of another format?)") from None
    if names is not None and text_field not in names:
        where = f"{shard.path} line 1" if shard.kind == "json" else f"{shard.path} row 0"
        raise DataError(where, f"no '{text_field}' field (fields: {', '.join(names)[:80]})",
                        missing_field_fix(names, data_format=data_format))


def _first_json_record_fields(shard: Shard) -> list[str] | None:
    opener = gzip.open if shard.path.name.endswith(".gz") else open
    with opener(shard.path, "rb") as f:
        for line in f:
            if line.strip():
                if line.lstrip().startswith(b"["):
                    return None  # a JSON array: checked record by record when read
                record = json.loads(line)
                return list(record) if isinstance(record, dict) else []
    return None


def check_corpus(corpus, seq_len: int, data_cfg) -> None:
    """Refuse token data too short for one sequence, naming the file. ``corpus``: a TokenFile, or
    the data.Corpus of several sources. (A vocabulary larger than the model's is refused before any
    process group, by validation: parallel3d/data/checks.py.)"""
    where = getattr(corpus, "path", None) or data_cfg.path or ", ".join(getattr(data_cfg, "sources", None) or [])
    sources = getattr(corpus, "sources", None)
    size = len(corpus) if sources is None else sum(len(a) for s in sources for a in s.arrays)
    if size >= seq_len + 1:
        return
    if sources is not None and sources[0].flags is not None:  # instruction rows: any sample fills a padded row
        raise RunError(f"{where or 'the corpus'} holds no instruction record. Fix: give records in data.sources")
    raise RunError(f"{where or 'the corpus'} holds {size} tokens, fewer than one sequence of "
                   f"train.seq_len={seq_len} needs ({seq_len + 1}). Fix: prepare more data "
                   f"(parallel3d-prepare-data) or lower train.seq_len")


def check_rows(*, key: str, path: str, metas: list[dict], data_cfg, seq_len: int) -> None:
    """Refuse an instruction source that would train nothing, in one line naming it: every sample
    left out (``data.truncation=drop``), or rows without a trained token (roles the template does
    not train, or every sample cut before its reply). ``metas``: its rows files' manifests."""
    total = {k: sum(m.get(k, 0) for m in metas) for k in ("samples", "rows", "trained_tokens", "dropped")}
    if total["samples"] == 0 or total["trained_tokens"] > 0:
        return  # an empty source: check_corpus and check_heldout say so
    if total["rows"] == 0:
        raise ConfigError(key, path, f"all {total['dropped']} samples are longer than train.seq_len + 1 = {seq_len + 1} "
                          f"tokens and data.truncation=drop leaves them out", "raise train.seq_len, or set "
                          "data.truncation=truncate (a sample keeps its beginning)")
    roles = roles_seen(path) if data_cfg.format == "chat" else []
    template = load_chat_template(tokenizer_spec=data_cfg.tokenizer, template_file=data_cfg.chat_template)
    blocks = template is not None and has_generation_blocks(template)
    if data_cfg.format == "chat" and ("assistant" not in roles or blocks):
        marked = ("the chat template's {% generation %} blocks mark none of their tokens" if blocks else
                  "data.train_on=assistant trains the turns of role 'assistant' only")
        raise ConfigError(key, path, f"no trained token in its {total['samples']} samples: their messages have the "
                          f"roles {', '.join(roles)}, and {marked}", "name the replies' role 'assistant' (and the "
                          "prompts' 'user'), or set data.train_on=all to train every token")
    raise ConfigError(key, path, f"no trained token in its {total['samples']} samples: each is cut to train.seq_len + 1 "
                      f"= {seq_len + 1} tokens before its first reply token", "raise train.seq_len")


def roles_seen(path: str, limit: int = 10_000) -> list[str]:
    """The message roles of a chat source's first ``limit`` records, in order of appearance."""
    seen: dict[str, None] = {}
    for shard in resolve(path):
        for index, record in enumerate(records(shard, ["messages"])):
            seen.update((m["role"], None) for m in record["messages"])
            if index >= limit:
                break
    return list(seen)


def check_heldout(corpus, *, seq_len: int, global_batch_size: int, eval_cfg) -> None:
    """Refuse held-out data shorter than one evaluation batch, as a config error naming the key:
    ``eval.fraction`` holds out each document with that chance, so on a small corpus it may hold
    out none (docs/data.md)."""
    tokens = sum(len(a) for s in corpus.sources for a in s.arrays)
    rows = corpus.sources[0].flags is not None  # instruction data: rows of seq_len + 1, each a window
    windows = tokens // (seq_len + 1) if rows else max(tokens - 1, 0) // seq_len
    if windows >= global_batch_size:
        return
    if rows:
        needs = f"one evaluation batch needs {global_batch_size} rows of train.seq_len + 1 tokens (train.global_batch_size)"
        held = f"{sample_count(corpus, seq_len + 1)} records in {windows} rows"
    else:
        needs = (f"one evaluation batch needs {global_batch_size * seq_len + 1} (train.global_batch_size x "
                 f"train.seq_len + 1)")
        held = f"{sum(int((a == corpus.eos_id).sum()) for s in corpus.sources for a in s.arrays)} documents ({tokens} tokens)"
    if eval_cfg.sources:
        raise ConfigError("eval.sources", list(eval_cfg.sources), f"they hold {held if rows else f'{tokens} tokens'}; "
                          f"{needs}", "give more held-out data" + ("" if rows else ", or lower train.seq_len"))
    raise ConfigError("eval.fraction", eval_cfg.fraction, f"it held out {held} of data.sources; {needs}",
                      f"raise eval.fraction (each {'record' if rows else 'document'} is held out with that chance), "
                      "or give held-out files in eval.sources")


def sample_count(corpus, width: int) -> int:
    """Instruction samples in ``corpus``'s rows of ``width`` tokens: the segments that start in
    them that are not padding."""
    count = 0
    for source in corpus.sources:
        for flags in source.flags:
            bits = np.asarray(flags)
            count += int(((bits & STARTS) != 0).sum() - ((bits.reshape(-1, width)[:, -1] & PADDING) != 0).sum())
    return count
