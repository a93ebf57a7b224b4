"""Data integrity: a content-keyed cache, checksummed cache files, bad records named in any file."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from harness.data_files import documents, write_jsonl

from parallel3d.data import TokenFile, integrity, load_tokenizer
from parallel3d.data import sources as src
from parallel3d.data.shards import prepare_shards


def _read(path) -> list[str]:
    return [t for shard in src.resolve(str(path)) for t in src.documents(shard, "text")]


def test_same_size_edit_with_the_mtime_kept_is_tokenized_again(tmp_path):
    data, cache, tok = tmp_path / "web.jsonl", tmp_path / "cache", load_tokenizer("byte")
    write_jsonl(data, ["alpha document", "beta document"])
    (shard,) = src.resolve(str(data))
    (before,) = prepare_shards([shard], tok, "text", 0.0, cache)
    stat = data.stat()
    # What `cp -p`, `rsync -t` or `tar x` leave: other bytes, the same size and modification time.
    data.write_bytes(data.read_bytes().replace(b"alpha", b"gamma"))
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    (after,) = prepare_shards([shard], tok, "text", 0.0, cache)
    assert after.train != before.train
    assert tok.decode(TokenFile(after.train).tokens.tolist()).startswith("gamma document")


@pytest.mark.fast
def test_an_unchanged_file_is_hashed_once(tmp_path, monkeypatch):
    data, memo = write_jsonl(tmp_path / "a.jsonl", documents("a", 20)), tmp_path / "digests"
    first = integrity.remembered_digest(data, memo)
    assert first == integrity.file_digest(data)
    monkeypatch.setattr(integrity, "file_digest", lambda path: pytest.fail(f"{path} hashed again"))
    assert integrity.remembered_digest(data, memo) == first
    copy = tmp_path / "b.jsonl"
    shutil.copy2(data, copy)  # same bytes, size and mtime; another inode and ctime: hashed, not trusted
    monkeypatch.setattr(integrity, "file_digest", lambda path: "computed")
    assert integrity.remembered_digest(copy, memo) == "computed"


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_corrupt_cache_file_is_rebuilt_with_a_line_naming_it(tmp_path, capsys, damage):
    data, cache, tok = tmp_path / "web.jsonl", tmp_path / "cache", load_tokenizer("byte")
    write_jsonl(data, documents("web", 30))
    (shard,) = src.resolve(str(data))
    (files,) = prepare_shards([shard], tok, "text", 0.1, cache)
    good = files.train.read_bytes()
    if damage == "flip":  # same size: only the checksum sees it
        files.train.write_bytes(good[:100] + bytes([good[100] ^ 0x40]) + good[101:])
    elif damage == "truncate":
        files.train.write_bytes(good[:-10])
    else:
        files.train.with_suffix(".json").write_text("{")
    assert integrity.token_file_problem(files.train) is not None
    capsys.readouterr()
    (again,) = prepare_shards([shard], tok, "text", 0.1, cache)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"rebuilding cached tokens {files.train}:" in lines[0], lines
    assert again.train == files.train and again.train.read_bytes() == good
    assert integrity.token_file_problem(again.train) is None
    assert json.loads(again.train.with_suffix(".json").read_text())["sha256"] == integrity.file_digest(again.train)


def test_a_bad_record_deep_in_a_large_jsonl_file_names_its_line(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "x" * 800, "id": i}) for i in range(4000)]
    for bad, problem in (('{"text": "cut short', "not valid JSON"), (json.dumps({"text": 5}), "holds int"),
                         ("[1, 2]", "not an object")):
        path = tmp_path / "big.jsonl"
        path.write_text("\n".join([*lines[:2900], bad, *lines[2901:]]) + "\n")
        assert path.stat().st_size > 2_000_000  # past pyarrow's read blocks: its row numbers restart
        with pytest.raises(src.DataError) as e:
            _read(path)
        message = str(e.value)
        assert "\n" not in message and f"{path} line 2901:" in message and problem in message, message
    # Fields other than the text are not parsed: their types may change from record to record.
    mixed = [json.dumps({"text": f"t{i}", "meta": i if i % 2 else str(i)}) for i in range(3000)]
    (tmp_path / "mixed.jsonl").write_text("\n".join(mixed) + "\n")
    assert len(_read(tmp_path / "mixed.jsonl")) == 3000


def test_a_json_array_source_gets_one_line_errors(tmp_path):
    path = tmp_path / "dump.json"
    path.write_text('[\n {"text": "a"},\n {"text": "b",}\n]\n')
    with pytest.raises(src.DataError) as e:
        _read(path)
    message = str(e.value)
    assert "\n" not in message and f"{path} line 3 column" in message and "not valid JSON" in message, message
    for record, problem in (("7", "not an object"), ('{"title": "x"}', "without the 'text' field"),
                            ('{"text": ["x"]}', "holds list")):
        path.write_text(f'[{{"text": "a"}}, {record}]')
        with pytest.raises(src.DataError) as e:
            _read(path)
        message = str(e.value)
        assert "\n" not in message and f"{path} array index 1:" in message and problem in message, message
    path.write_text('{"text": "one object, not an array"}\n')
    assert _read(path) == ["one object, not an array"]  # read as JSON lines


def test_an_empty_token_file_opens(tmp_path):
    from parallel3d.data import write_token_file

    out = write_token_file([], load_tokenizer("byte"), tmp_path / "empty.bin")
    assert len(TokenFile(out)) == 0


def test_eval_fraction_on_a_corpus_too_small_to_hold_out_a_batch_is_one_config_line(tmp_path):
    from harness.runs import launch

    from parallel3d.base import ConfigError
    from parallel3d.config.compose import compose
    from parallel3d.data import open_eval_corpus
    from parallel3d.data.checks import check_heldout

    web = write_jsonl(tmp_path / "web.jsonl", documents("web", 40))
    overrides = [f"data.sources=[{web}]", f"data.cache_dir={tmp_path / 'cache'}", "eval.fraction=0.01"]
    cfg = compose(overrides)
    held_out = open_eval_corpus(cfg.data, cfg.eval)  # empty held-out files open (no mmap of an empty file)
    with pytest.raises(ConfigError) as e:
        check_heldout(held_out, seq_len=32, global_batch_size=4, eval_cfg=cfg.eval)
    message = str(e.value)
    assert "\n" not in message and message.startswith("eval.fraction=0.01: it held out 0 documents"), message
    # The README's "Bring your data" command on such a corpus: one line, exit 2, before any step.
    run = launch(tmp_path / "run", [*overrides, "train.steps=2", "optim.warmup_steps=1", "train.seq_len=32",
                                         "train.global_batch_size=4"])
    assert run.returncode == 2 and not run.metrics, run.stderr[-2000:]
    assert "parallel3d: config error: eval.fraction=0.01: it held out 0 documents" in run.stderr, run.stderr[-2000:]
    assert "Traceback" not in run.stderr


def test_sigterm_while_tokenizing_is_one_line_and_leaves_no_lock(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from harness.runs import env

    for i in range(6):  # long enough to be stopped while a shard is being written
        write_jsonl(tmp_path / "src" / f"part-{i}.jsonl", documents(f"p{i}", 8000, i))
    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "parallel3d.train", f"run_dir={run_dir}",
                             f"data.sources=[{tmp_path / 'src'}]", f"data.cache_dir={cache}"],
                            cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):  # a shard being written: a temporary file in the cache
            if list(cache.glob(".*.tmp")) or proc.poll() is not None:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    (line,) = [x for x in err.splitlines() if x.strip()]
    assert line.startswith("parallel3d: stopped by SIGTERM while preparing the data, before the first step"), line
    assert not (run_dir / ".lock").exists() and not list(cache.glob(".*.tmp"))


def test_a_missing_cache_file_beside_its_manifest_is_rebuilt(tmp_path, capsys):
    data, cache, tok = tmp_path / "web.jsonl", tmp_path / "cache", load_tokenizer("byte")
    write_jsonl(data, documents("web", 10))
    (shard,) = src.resolve(str(data))
    (files,) = prepare_shards([shard], tok, "text", 0.0, cache)
    good = files.train.read_bytes()
    files.train.unlink()
    (again,) = prepare_shards([shard], tok, "text", 0.0, cache)
    assert f"rebuilding cached tokens {files.train}: it is missing" in capsys.readouterr().err
    assert again.train.read_bytes() == good


def test_a_tampered_prepared_token_file_is_named(tmp_path):
    from types import SimpleNamespace

    from parallel3d.base import RunError
    from parallel3d.data import open_sources, write_token_file
    from parallel3d.data.corpus import open_single

    out = write_token_file(documents("doc", 20), load_tokenizer("byte"), tmp_path / "corpus.bin")
    cfg = SimpleNamespace(tokenizer="byte", text_field="text", cache_dir=str(tmp_path / "cache"), source="file",
                          path=str(out))
    assert len(open_sources([str(out)], cfg, 0.0).tokens) == len(TokenFile(out))
    good = out.read_bytes()
    out.write_bytes(good[:50] + bytes([good[50] ^ 0x01]) + good[51:])  # a token id changed, same size
    for opening in (lambda: open_sources([str(out)], cfg, 0.0), lambda: open_single(cfg)):
        with pytest.raises(RunError) as e:
            opening()
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{out}: its sha256 differs") and "Fix:" in message
