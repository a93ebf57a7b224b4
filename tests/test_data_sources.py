"""Sources (every kind, via pyarrow/datasets), bad input, the shard cache and held-out documents."""

from __future__ import annotations

import copy
import json
import threading

import numpy as np
import pytest
from harness.data_files import documents, write_jsonl, write_mixture, write_parquet, write_saved_dataset

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.data import TokenFile, load_tokenizer, open_eval_corpus, open_sources, write_token_file
from parallel3d.data import sources as src
from parallel3d.data.shards import is_heldout, prepare_shards, shard_files
from parallel3d.validate import check


def _read(path) -> list[str]:
    return [t for shard in src.resolve(str(path)) for t in src.documents(shard, "text")]


@pytest.mark.fast
def test_every_source_kind_reads_its_documents_in_order(tmp_path):
    a, b = documents("a", 30), documents("b", 20)
    assert _read(write_jsonl(tmp_path / "a.jsonl", a)) == a
    assert _read(write_jsonl(tmp_path / "b.jsonl.gz", b, gz=True)) == b
    (tmp_path / "arr.json").write_text(json.dumps([{"text": t} for t in b]))
    assert _read(tmp_path / "arr.json") == b
    assert _read(write_parquet(tmp_path / "p" / "a.parquet", a)) == a
    assert _read(write_saved_dataset(tmp_path / "saved", a, shards=3)) == a
    assert [s.kind for s in src.resolve(str(tmp_path / "saved"))] == ["arrow"] * 3
    assert _read(str(tmp_path / "*.jsonl*")) == a + b  # a glob, sorted
    folder = tmp_path / "texts"
    for i, t in enumerate(b[:3]):
        (folder / f"{i}.txt").parent.mkdir(exist_ok=True)
        (folder / f"{i}.txt").write_text(t)
    assert _read(folder) == b[:3]  # a text folder: each file a document
    assert [s.kind for s in src.resolve(str(tmp_path / "p"))] == ["parquet"]  # a folder of data files
    custom = write_jsonl(tmp_path / "c.jsonl", a, field="body")
    assert [t for s in src.resolve(str(custom)) for t in src.documents(s, "body")] == a
    assert src.source_name(str(tmp_path / "b.jsonl.gz")) == "b" and src.source_name("x/wiki/") == "wiki"


def test_json_lines_of_any_size_are_read(tmp_path):
    """pyarrow reads JSON in 1 MiB blocks and refuses a line longer than one: a 3 MB and a 100 MB
    document (and a 3 MB one gzipped) read whole, with the short ones around them."""
    texts = ["short", "x" * 3_000_000, "y" * 100_000_000, "last"]
    path = write_jsonl(tmp_path / "long.jsonl", texts)
    assert _read(path) == texts
    assert src._longest_line(path) == len(json.dumps({"text": texts[2], "id": 2}))
    assert _read(write_jsonl(tmp_path / "long.jsonl.gz", texts[:2], gz=True)) == texts[:2]


def _one_line_error(exc: pytest.ExceptionInfo, *parts: str) -> str:
    message = str(exc.value)
    assert "\n" not in message and "Fix:" in message, message
    for part in parts:
        assert part in message, (part, message)
    return message


def test_records_without_text_and_undecodable_bytes_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"title": "no text"}\n', encoding="utf-8")
    with pytest.raises(src.DataError) as e:
        _read(path)
    _one_line_error(e, f"{path} line 4", "without the 'text' field")
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9 latin-1"}\n')
    with pytest.raises(src.DataError) as e:
        _read(path)
    _one_line_error(e, f"{path} line 2", "not UTF-8", "re-encode")
    parquet = write_parquet(tmp_path / "nulls.parquet", ["a", None, "c"] * 5)
    with pytest.raises(src.DataError) as e:
        _read(parquet)
    _one_line_error(e, f"{parquet} row 1")


@pytest.fixture(scope="module")
def base_cfg():
    return compose([])


def _check(base_cfg, **groups):
    """Validate the default config with these data/eval keys set (composing once: it takes a second)."""
    cfg = copy.deepcopy(base_cfg)
    cfg.run_dir = "/nonexistent/run"  # resolved outside a Hydra run
    for group, values in groups.items():
        for key, value in values.items():
            cfg[group][key] = value
    check(cfg, 1)


@pytest.mark.parametrize("case", ["empty_file", "empty_folder", "missing", "corrupt_parquet", "no_field_parquet",
                                  "no_field_jsonl", "no_field_saved", "weights_length", "weights_negative",
                                  "vocab"])
def test_bad_input_is_one_line_before_any_process_group(tmp_path, base_cfg, case):
    good = str(write_jsonl(tmp_path / "good.jsonl", documents("g", 5)))
    sources, data, expect = None, {}, []
    if case == "empty_file":
        (tmp_path / "empty.jsonl").write_text("")
        sources, expect = [str(tmp_path / "empty.jsonl")], ["empty.jsonl", "the source is empty"]
    elif case == "empty_folder":
        (tmp_path / "void").mkdir()
        sources, expect = [str(tmp_path / "void")], ["void", "the source is empty"]
    elif case == "missing":
        sources, expect = [str(tmp_path / "nope.parquet")], ["nope.parquet", "no such file"]
    elif case == "corrupt_parquet":
        whole = write_parquet(tmp_path / "c.parquet", documents("c", 20)).read_bytes()
        (tmp_path / "c.parquet").write_bytes(whole[: len(whole) // 2])  # truncated: no footer
        sources, expect = [good, str(tmp_path / "c.parquet")], ["c.parquet", "cannot be read"]
    elif case == "no_field_parquet":
        sources = [str(write_parquet(tmp_path / "t.parquet", ["x"], field="content"))]
        expect = ["t.parquet row 0", "no 'text' field", "data.text_field"]
    elif case == "no_field_jsonl":
        sources, expect = [str(write_jsonl(tmp_path / "t.jsonl", ["x"], field="body"))], ["t.jsonl line 1", "body"]
    elif case == "no_field_saved":
        from datasets import Dataset

        Dataset.from_dict({"content": ["x"]}).save_to_disk(str(tmp_path / "ds"))
        sources, expect = [str(tmp_path / "ds")], ["ds/data-00000-of-00001.arrow row 0", "no 'text' field"]
    elif case.startswith("weights"):
        sources = [good, good]
        data = {"weights": [1.0] if case == "weights_length" else [1.0, -1.0]}
        expect = ["data.weights=", "one weight per source" if case == "weights_length" else ">= 0"]
    elif case == "vocab":
        class Big:
            vocab_size, eos_id, bos_id, name = 1000, 999, None, "big"

            def encode(self, text):
                return [1, 2]

        out = write_token_file(["a"], Big(), tmp_path / "big.bin")
        data, expect = {"source": "file", "path": str(out)}, ["big.bin", "vocabulary of 1000", "model.vocab_size=512"]
    if sources is not None:
        data["sources"] = sources
    with pytest.raises(ConfigError) as e:
        _check(base_cfg, data=data)
    _one_line_error(e, *expect)


def test_good_sources_and_eval_pass_validation(tmp_path, base_cfg):
    sources = write_mixture(tmp_path)
    _check(base_cfg, data={"sources": sources, "weights": [1, 2, 0.5]}, eval={"fraction": 0.1})
    with pytest.raises(ConfigError, match="eval.fraction"):
        _check(base_cfg, eval={"fraction": 0.1})  # nothing to hold out from


def test_shards_are_split_among_ranks_cached_by_content_and_never_redone(tmp_path):
    sources = write_mixture(tmp_path / "src")
    shards = [s for p in sources for s in src.resolve(p)]
    assert len(shards) == 5
    tok, cache = load_tokenizer("byte"), tmp_path / "cache"
    barrier = threading.Barrier(3)  # three ranks (threads); each takes shards rank, rank + 3, ...
    ranks = [threading.Thread(target=prepare_shards, args=(shards, tok, "text", 0.0, cache, r, 3, barrier.wait))
             for r in range(3)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    files = prepare_shards(shards, tok, "text", 0.0, cache)  # all done: nothing tokenized again
    by = [TokenFile(f.train).meta["tokenized_by"] for f in files]
    assert by == ["rank 0", "rank 1", "rank 2", "rank 0", "rank 1"]
    stamps = [f.train.stat().st_mtime_ns for f in files]
    prepare_shards(shards, tok, "text", 0.0, cache, 0, 1)
    assert [f.train.stat().st_mtime_ns for f in files] == stamps
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    # The key follows the content, the text field, the held-out fraction and the tokenizer.
    assert shard_files(shards[0], tok, "body", 0.0, cache).train != files[0].train
    assert shard_files(shards[0], tok, "text", 0.1, cache).train != files[0].train
    write_jsonl(shards[0].path, documents("web", 41))
    assert shard_files(shards[0], tok, "text", 0.0, cache).train != files[0].train
    # A shard missing after every rank finished (a cache that is not shared) is an error, not a hang.
    with pytest.raises(RuntimeError, match="shared"):
        prepare_shards(shards, tok, "text", 0.0, tmp_path / "other", 0, 2, barrier=lambda: None)


def _docs_of(tokens: np.ndarray, tok) -> list[str]:
    """Document k is the tokens after the k-th EOS (the EOS ends its document)."""
    ends = np.flatnonzero(tokens == tok.eos_id)
    return [tok.decode([i for i in tokens[a + 1 : b].tolist() if i != tok.bos_id])
            for a, b in zip([-1, *ends[:-1]], ends)]


def test_held_out_documents_are_never_trained_on(tmp_path):
    sources = write_mixture(tmp_path / "src")
    data = compose([f"data.sources=[{','.join(sources)}]", f"data.cache_dir={tmp_path / 'cache'}",
                    "eval.fraction=0.2"])
    train = open_sources(sources, data.data, 0.2)
    held = open_eval_corpus(data.data, data.eval)
    tok = load_tokenizer("byte")
    every = [t for p in sources for t in _read(p)]
    train_docs = [d for s in train.sources for a in s.arrays for d in _docs_of(np.asarray(a), tok)]
    held_docs = _docs_of(held.tokens, tok)
    assert sorted(train_docs + held_docs) == sorted(every)
    assert 0.1 < len(held_docs) / len(every) < 0.3
    assert all(is_heldout(d, 0.2) for d in held_docs) and not any(is_heldout(d, 0.2) for d in train_docs)
    assert train.eos_id == 256 and train.bos_id is None and [s.name for s in train.sources] == ["web", "books", "wiki"]
    assert open_eval_corpus(data.data, compose(["eval.fraction=0"]).eval) is None
    separate = open_eval_corpus(data.data, compose([f"eval.sources=[{sources[1]}]"]).eval)
    assert _docs_of(separate.tokens, tok) == _read(sources[1])


def test_bos_starts_each_document_where_the_tokenizer_has_one(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    hf.train_from_iterator(documents("t", 50), trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    texts = documents("d", 4)
    tokens = TokenFile(write_token_file(texts, tok, tmp_path / "t.bin")).tokens.tolist()
    expected = [i for t in texts for i in (tok.bos_id, *tok.encode(t), tok.eos_id)]
    assert tokens == expected
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
