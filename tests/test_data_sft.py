"""Instruction data in rows: packing, padding, truncation, the flags, and the config refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
from harness.chat_files import chat_tokenizer_folder, write_jsonl

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.data.sft import (IGNORE, PADDING, STARTS, TRAINED, RowStats, SFTSpec, build_rows, render_sample, row_fill,
                                  row_micro_batches)
from parallel3d.data.tokenizer import ByteTokenizer
from parallel3d.validate import check


def spec(**kw) -> SFTSpec:
    base = dict(format="prompt_response", prompt_field="prompt", response_field="response", template=None,
                train_on="assistant", packing=True, truncation="truncate", seq_len=7)
    return SFTSpec(**{**base, **kw})


def sample(n: int, trained_from: int) -> tuple[list[int], list[bool]]:
    return list(range(10, 10 + n)), [i >= trained_from for i in range(n)]


@pytest.mark.fast
@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("truncation", ["truncate", "drop"])
def test_rows_pack_pad_and_count_what_does_not_fit(packing, truncation):
    stats = RowStats()
    rows = list(build_rows([sample(3, 1), sample(4, 2), sample(12, 10), sample(2, 0)],
                           spec(packing=packing, truncation=truncation), pad_id=0, stats=stats))
    tokens, flags = map(np.stack, zip(*rows))
    assert tokens.shape[1] == 8 and (stats.truncated, stats.dropped) == ((1, 0) if truncation == "truncate" else (0, 1))
    starts = [list(np.flatnonzero(f & STARTS)) for f in flags]
    if packing:  # best fit, longest first: the long sample takes a row; 4 + 3 fill one but a token; 2 pads
        expected = [[0], [0, 4, 7], [0, 2]] if truncation == "truncate" else [[0, 4, 7], [0, 2]]
    else:
        expected = [[0, 3], [0, 4], [0], [0, 2]] if truncation == "truncate" else [[0, 3], [0, 4], [0, 2]]
    assert starts == expected
    assert not (flags[:, 0] & TRAINED).any() and not any(f[s] & TRAINED for f, ss in zip(flags, starts) for s in ss)
    assert stats.trained_tokens == int((flags & TRAINED).astype(bool).sum()) and stats.rows == len(rows)


def log_uniform_records(count: int, seed: int) -> list[dict]:
    """Prompt/response records of log-uniform lengths, 16-1024 bytes each (tools/bench_sft.py's kind)."""
    import math
    import random

    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return "x" * int(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    return [{"prompt": text(16, 1024), "response": text(16, 1024)} for _ in range(count)]


def test_packed_rows_are_at_least_95_percent_samples():
    """Greedy packing in file order left a fifth of each row empty on such lengths (BENCHMARKS (k))."""
    tok, sft = ByteTokenizer(), spec(seq_len=512)
    stats = RowStats()
    rows = list(build_rows((render_sample(r, sft, tok) for r in log_uniform_records(3000, seed=0)), sft,
                           pad_id=tok.eos_id, stats=stats))
    flags = np.stack([f for _, f in rows])
    assert row_fill(flags) == stats.sample_tokens / flags.size >= 0.95, (stats, row_fill(flags))
    assert stats.truncated > 0 and stats.samples == 3000  # long samples fill a row of their own, cut
    assert not (flags[:, -1] & PADDING).all() and ((flags & PADDING) == 0).sum() == stats.sample_tokens


def test_packing_is_a_function_of_the_samples_alone():
    """The same records give the same rows however they arrive (a list, a generator) and whichever
    process builds them; the packed samples are the records', each whole, each once."""
    tok, sft = ByteTokenizer(), spec(seq_len=512)
    samples = [render_sample(r, sft, tok) for r in log_uniform_records(1500, seed=1)]
    first = list(build_rows(samples, sft, pad_id=tok.eos_id, stats=RowStats()))
    again = list(build_rows(iter(samples), sft, pad_id=tok.eos_id, stats=RowStats()))
    assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(first, again)) and len(first) == len(again)
    segments = sorted(tuple(t[s:e]) for t, f in first
                      for s, e in zip(*(lambda b: (b, [*b[1:], len(f)]))(list(np.flatnonzero(f & STARTS))))
                      if not f[s] & PADDING)
    assert segments == sorted(tuple(ids[:513]) for ids, _ in samples)


def test_packed_batches_and_their_fill_are_the_same_at_any_layout_and_on_resume():
    """Step 3's rows: two data-parallel ranks' slices are one process's batch; a sampler resumed
    after step 2 (its data position, ``offset``) draws the same rows; ``row_fill`` agrees."""
    import torch

    from parallel3d.data import BatchSpec, StepSampler

    tok, sft = ByteTokenizer(), spec(seq_len=512)
    rows = list(build_rows((render_sample(r, sft, tok) for r in log_uniform_records(400, seed=2)), sft,
                           pad_id=tok.eos_id, stats=RowStats()))
    tokens, flags = (np.concatenate(a) for a in zip(*rows))

    def sampler(dp_rank=0, dp_size=1, offset=0):
        return StepSampler(tokens, BatchSpec(8, 2, 512, dp_rank, dp_size), seed=5, offset=offset, flags=flags)

    one = sampler().micro_batches(3)
    ranks = [mb for r in range(2) for mb in sampler(r, 2).micro_batches(3)]
    resumed = sampler(offset=2 * 8).micro_batches(1)
    for other in (ranks, resumed):
        assert all(torch.equal(a, b) for x, y in zip(one, other) for a, b in zip(x, y)) and len(one) == len(other)
    fill = sampler().batch_fill(3)["row_fill"]
    assert fill == sampler(1, 2).batch_fill(3)["row_fill"] == sampler(offset=16).batch_fill(1)["row_fill"]
    assert 0.5 < fill <= 1


def test_micro_batches_mask_untrained_targets_and_carry_the_samples():
    rows = list(build_rows([sample(3, 1), sample(4, 2)], spec(), pad_id=0, stats=RowStats()))
    tokens, flags = map(np.stack, zip(*rows))
    ((inputs, targets, samples),) = row_micro_batches(tokens, flags, 1, packed=True)
    assert inputs.tolist() == [[10, 11, 12, 13, 10, 11, 12]]  # the longer sample first
    # target j is token j + 1: the first sample's 3rd and 4th, the second's 2nd and 3rd; no cross-sample
    # target, none into the padding
    assert targets.tolist() == [[IGNORE, 12, 13, IGNORE, 11, 12, IGNORE]]
    assert samples.tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    assert len(row_micro_batches(tokens, flags, 1, packed=False)[0]) == 2


def test_prompt_response_without_a_template_is_prompt_response_eos():
    tok = ByteTokenizer()
    ids, mask = render_sample({"prompt": "ab", "response": "c"}, spec(), tok)
    assert ids == [97, 98, 99, tok.eos_id] and mask == [False, False, True, True]
    assert render_sample({"prompt": "ab", "response": "c"}, spec(train_on="all"), tok)[1] == [True] * 4


def test_a_chat_prompt_response_trains_the_reply_and_its_end_of_turn(tmp_path):
    from parallel3d.data.chat import load_chat_template
    from parallel3d.data.tokenizer import HFTokenizer

    folder = chat_tokenizer_folder(tmp_path / "tok", "qwen3")
    tok = HFTokenizer(folder / "tokenizer.json")
    template = load_chat_template(tokenizer_spec=str(folder))
    ids, mask = render_sample({"prompt": "Tell me a joke.", "response": "Sure."}, spec(template=template), tok)
    trained = tok._tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert trained == "<think>\n\n</think>\n\nSure.<|im_end|>"


@pytest.fixture(scope="module")
def untemplated(tmp_path_factory):
    """A tokenizer folder without a chat template, and a template that never closes a turn."""
    root = tmp_path_factory.mktemp("untemplated")
    folder = chat_tokenizer_folder(root / "tok", "llama3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "bad.jinja").write_text("{{ messages[0]['content'] }}")
    return folder / "tokenizer.json", root / "bad.jinja"


@pytest.mark.parametrize("keys, refused", [
    ({"format": "chat"}, "data.format"),  # the byte tokenizer has no template
    ({"format": "chat", "tokenizer": "TOK"}, "data.format"),  # a folder without one
    ({"format": "chat", "chat_template": "/nonexistent.jinja"}, "data.chat_template"),
    ({"format": "chat", "tokenizer": "TOK", "chat_template": "BAD"}, "data.chat_template"),
    ({"format": "prompt_response", "train_on": "prompt"}, "data.train_on"),
    ({"format": "prompt_response", "truncation": "cut"}, "data.truncation"),
    ({"format": "dialog"}, "data.format"),
    ({"format": "chat", "sources": []}, "data.format"),
])
def test_bad_instruction_configs_are_refused_with_one_line(untemplated, keys, refused):
    from parallel3d.config.schema import DataConfig
    from parallel3d.data.checks import check_instruction_data

    tokenizer, bad = untemplated
    values = {k: str(tokenizer) if v == "TOK" else str(bad) if v == "BAD" else v for k, v in keys.items()}
    with pytest.raises(ConfigError, match=refused.replace(".", r"\.")) as err:
        check_instruction_data(DataConfig(**{"sources": ["records.jsonl"], **values}))
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)


def test_validation_refuses_a_chat_without_a_template(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(ConfigError, match=r"data\.format=chat: the byte tokenizer has no chat template"):
        check(compose([f"data.sources=[{data}]", "data.format=chat"]), 1)


def test_prepare_data_writes_the_rows_a_run_reads(tmp_path):
    from harness.chat_files import chat_records

    from parallel3d.cli import prepare_data
    from parallel3d.data.corpus import open_sources

    folder = chat_tokenizer_folder(tmp_path / "tok", "qwen3")
    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(20))
    tokenizer, cache = str(folder / "tokenizer.json"), str(tmp_path / "cache")
    assert prepare_data.main(["--source", str(data), "--cache-dir", cache, "--workers", "1", "--tokenizer", tokenizer,
                              "--format", "chat", "--seq-len", "64", "--no-packing"]) == 0
    c = compose([f"data.sources=[{data}]", f"data.tokenizer={tokenizer}", "data.format=chat",
                 f"data.cache_dir={cache}", "data.packing=false"])
    corpus = open_sources([str(data)], c.data, 0.0, seq_len=64)
    metas = [json.loads(p.read_text()) for p in (tmp_path / "cache").glob("*.json")]
    assert all(m["tokenized_by"].startswith("worker") for m in metas if "rows_of" in m)  # found, not redone
    assert len(corpus.tokens) == 20 * 65 and len(corpus.flags) == len(corpus.tokens)  # one chat a row


# -- sources that would train nothing, and the hints that name the right key --------------------

def sft_run_config(tmp_path, data, *extra):
    tokenizer = chat_tokenizer_folder(tmp_path / "tok", "llama3")
    return compose([f"data.sources=[{data}]", f"data.tokenizer={tokenizer}", "data.format=chat", "train.seq_len=64",
                    f"data.cache_dir={tmp_path / 'cache'}", *extra])


def open_training_rows(c):
    from parallel3d.data import BatchSpec, build_train_data

    return build_train_data(c.data, c.eval, BatchSpec(8, 8, c.train.seq_len), c.train.seed)


def test_a_source_without_a_trained_token_is_refused_naming_its_roles(tmp_path):
    """ShareGPT's roles (human/gpt) through a template that renders any role: no turn is an
    assistant's, so nothing would train (loss 0, weight decay alone moving the weights)."""
    records = [{"messages": [{"role": "human", "content": f"question {i}"}, {"role": "gpt", "content": "answer"}]}
               for i in range(40)]
    data = write_jsonl(tmp_path / "sharegpt.jsonl", records)
    c = sft_run_config(tmp_path, data)
    check(c, 1)  # nothing to see before the records are rendered
    with pytest.raises(ConfigError) as err:
        open_training_rows(c)
    line = str(err.value)
    assert line.startswith(f"data.sources={data}: no trained token in its 40 samples") and "\n" not in line
    assert "roles human, gpt" in line and "'assistant'" in line and "data.train_on=all" in line
    open_training_rows(sft_run_config(tmp_path, data, "data.train_on=all"))  # the fix it names runs


def test_a_source_whose_samples_are_all_dropped_names_truncation(tmp_path):
    from harness.chat_files import chat_records

    data = write_jsonl(tmp_path / "chats.jsonl", chat_records(6))
    with pytest.raises(ConfigError) as err:
        open_training_rows(sft_run_config(tmp_path, data, "train.seq_len=8", "data.truncation=drop"))
    assert "all 6 samples are longer than train.seq_len + 1 = 9 tokens and data.truncation=drop" in str(err.value)
    assert "Fix: raise train.seq_len, or set data.truncation=truncate" in str(err.value)


def test_a_template_error_names_the_record(tmp_path):
    strict = tmp_path / "strict.jinja"  # as templates that check the roles do
    strict.write_text("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                      "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
                      "{{ m['role'] + ': ' + m['content'] + '<|eot_id|>' }}{% endfor %}")
    ok = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    bad = {"messages": [{"role": "assistant", "content": "b"}]}
    data = write_jsonl(tmp_path / "chats.jsonl", [ok, ok, bad, ok])
    with pytest.raises(ConfigError) as err:
        open_training_rows(sft_run_config(tmp_path, data, f"data.chat_template={strict}"))
    assert str(err.value).startswith(f"data.sources={data} record 2: the chat template {strict} fails on it "
                                     "(roles must alternate user/assistant)")


@pytest.mark.parametrize("records, keys, fix", [
    ([{"prompt": "a", "response": "b"}], [], "these are prompt/response records: set data.format=prompt_response."),
    ([{"question": "a", "answer": "b"}], [], "these are prompt/response records: set data.format=prompt_response "
                                             "data.prompt_field=question data.response_field=answer."),
    ([{"question": "a", "answer": "b"}], ["data.format=prompt_response"],
     "set data.prompt_field=question data.response_field=answer."),
    ([{"messages": [{"role": "user", "content": "a"}]}], ["data.format=prompt_response"],
     "these are chat records: set data.format=chat."),
])
def test_records_of_another_format_name_the_key_that_reads_them(tmp_path, records, keys, fix):
    data = write_jsonl(tmp_path / "d.jsonl", records)
    with pytest.raises(ConfigError) as err:
        check(compose([f"data.sources=[{data}]", *keys]), 1)
    assert str(err.value).endswith(f"Fix: {fix}"), str(err.value)


def test_a_mistyped_folder_is_named_not_the_byte_tokenizer(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "a"}]}])
    with pytest.raises(ConfigError) as err:
        check(compose([f"checkpoint.init_from={tmp_path / 'Llama-3-typo'}", f"data.sources=[{data}]",
                       "data.format=chat"]), 1)
    assert str(err.value).startswith(f"checkpoint.init_from={tmp_path / 'Llama-3-typo'}: no such file or folder")


def test_too_little_held_out_data_counts_records_not_padding(tmp_path):
    """eval.fraction on chat records: the refusal counts the records held out (several per packed
    row), not the padding tokens that share the eos id."""
    from harness.chat_files import chat_records

    from parallel3d.data import open_eval_corpus
    from parallel3d.data.checks import check_heldout
    from parallel3d.data.shards import is_heldout

    records = chat_records(60)
    data = write_jsonl(tmp_path / "chats.jsonl", records)
    c = sft_run_config(tmp_path, data, "eval.fraction=0.2")
    held_out = open_eval_corpus(c.data, c.eval, seq_len=64)
    expected = sum(is_heldout(json.dumps(r, sort_keys=True), 0.2) for r in records)
    rows = len(held_out.tokens) // 65
    assert 0 < rows < expected  # packed: fewer rows than records
    with pytest.raises(ConfigError, match=rf"^eval\.fraction=0\.2: it held out {expected} records in {rows} rows"):
        check_heldout(held_out, seq_len=64, global_batch_size=rows + 1, eval_cfg=c.eval)
