"""Tokenizers, token files, parallel3d-prepare-data, the stdlib corpus and the layout-invariant sampler."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from parallel3d.config.compose import PROJECT_ROOT
from parallel3d.data import (BatchSpec, ByteTokenizer, HFTokenizer, StepSampler, TokenFile, load_tokenizer,
                             stdlib_token_file, text_files, write_token_file)

DOCS = ["hello world", "grüße, 世界 — ∑ x²", "", "def f(x):\n    return x + 1\n"]


# --- tokenizers -------------------------------------------------------------------------------------

@pytest.mark.fast
def test_byte_tokenizer_round_trip_and_special_ids():
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert tok.vocab_size == 257 and tok.eos_id == 256
    for text in DOCS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    # Non-ASCII text takes several bytes per character; EOS is dropped when decoding.
    assert len(tok.encode("世")) == 3
    assert tok.decode(tok.encode("ab") + [tok.eos_id] + tok.encode("ç")) == "abç"


def _train_hf_tokenizer(path: Path, eos: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DOCS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    out = path / "tokenizer.json"
    tok.save(str(out))
    return out


@pytest.mark.parametrize("eos", ["<|end_of_text|>", "</s>"])
def test_hf_tokenizer_from_local_file(tmp_path, eos):
    from tokenizers import Tokenizer

    path = _train_hf_tokenizer(tmp_path, eos)
    reference = Tokenizer.from_file(str(path))
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == reference.token_to_id(eos)
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True)
    for text in DOCS:
        ids = tok.encode(text)
        assert tok.eos_id not in ids
        assert tok.decode(ids) == text
    assert len(tok.encode("the quick brown fox")) < len("the quick brown fox".encode())  # merges learned

    out = write_token_file(DOCS, tok, tmp_path / "hf.bin")
    tf = TokenFile(out)
    expected = [i for text in DOCS for i in [*tok.encode(text), tok.eos_id]]
    assert tf.tokens.tolist() == expected
    assert tf.meta["tokenizer"] == str(path) and tf.meta["vocab_size"] == tok.vocab_size
    assert tf.tokens.dtype == np.uint16


def test_hf_tokenizer_without_eos_token_is_rejected(tmp_path):
    path = _train_hf_tokenizer(tmp_path, "<pad>")
    with pytest.raises(ValueError, match="end-of-text"):
        load_tokenizer(str(path))


# --- token files ------------------------------------------------------------------------------------

def test_write_token_file_round_trip(tmp_path):
    tok = ByteTokenizer()
    seen = []
    out = write_token_file(iter(DOCS), tok, tmp_path / "sub" / "corpus.bin", progress=seen.append)
    assert out == tmp_path / "sub" / "corpus.bin"
    tf = TokenFile(out)
    expected = [i for text in DOCS for i in [*tok.encode(text), tok.eos_id]]
    assert len(tf) == len(expected)
    assert tf.tokens.dtype == np.uint16
    assert tf.tokens.tolist() == expected
    assert tf.meta == {"dtype": "uint16", "num_tokens": len(expected), "tokenizer": "byte", "vocab_size": 257,
                       "bytes": 2 * len(expected), "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
    assert json.loads(out.with_suffix(".json").read_text()) == tf.meta
    assert out.stat().st_size == 2 * len(expected)
    assert seen[-1] == len(expected) and seen == sorted(seen)  # progress counts tokens so far
    # Document boundaries are exactly the EOS positions.
    eos = np.flatnonzero(tf.tokens == tok.eos_id)
    assert len(eos) == len(DOCS)
    assert [tok.decode(d.tolist()) for d in np.split(tf.tokens, eos + 1)[:-1]] == DOCS
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus.bin", "corpus.json"]  # no temp files left


def test_large_vocabulary_uses_uint32(tmp_path):
    class BigVocab:
        vocab_size, eos_id, name = 100_000, 99_999, "big"

        def encode(self, text):
            return [70_000 + len(text), 5]

    tf = TokenFile(write_token_file(["abc", "de"], BigVocab(), tmp_path / "big.bin"))
    assert tf.tokens.dtype == np.uint32
    assert tf.tokens.tolist() == [70_003, 5, 99_999, 70_002, 5, 99_999]


def test_token_file_without_sidecar_raises(tmp_path):
    out = write_token_file(["abc"], ByteTokenizer(), tmp_path / "x.bin")
    out.with_suffix(".json").unlink()
    with pytest.raises(FileNotFoundError, match="x.json"):
        TokenFile(out)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(10, dtype=np.uint16).tobytes())
    with pytest.raises(FileNotFoundError):
        TokenFile(raw)


def _write_corpus(root: Path) -> dict[str, str]:
    files = {"a.txt": "first document\n", "b.txt": "zweites Dokument — ü\n", "nested/c.txt": "third\n",
             "notes.md": "# markdown, not txt\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / "blob.dat").write_bytes(b"\xff\xfe\x00binary")  # not UTF-8: skipped
    return files


def test_text_files_order_pattern_and_max_bytes(tmp_path):
    files = _write_corpus(tmp_path)
    assert list(text_files(tmp_path, "**/*.txt")) == [files["a.txt"], files["b.txt"], files["nested/c.txt"]]
    assert list(text_files(tmp_path, "*.txt")) == [files["a.txt"], files["b.txt"]]
    # Stops after the file that reaches max_bytes.
    assert list(text_files(tmp_path, "**/*.txt", max_bytes=1)) == [files["a.txt"]]
    assert all(t != "" for t in text_files(tmp_path))


def _prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallel3d.cli.prepare_data", *args], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_prepare_data_tool(tmp_path):
    corpus = tmp_path / "corpus"
    files = _write_corpus(corpus)
    tok = ByteTokenizer()

    out_all = tmp_path / "out" / "all.bin"
    proc = _prepare("--input", str(corpus), "--output", str(out_all))
    assert proc.returncode == 0, proc.stderr
    texts = [files[k] for k in sorted(files, key=lambda k: str(corpus / k))]  # blob.dat is skipped
    tf = TokenFile(out_all)
    assert len(tf) == sum(len(tok.encode(t)) + 1 for t in texts)
    assert tf.tokens.tolist() == [i for t in texts for i in [*tok.encode(t), tok.eos_id]]
    assert f"{len(tf):,} tokens" in proc.stdout

    out_txt = tmp_path / "out" / "txt.bin"
    proc = _prepare("--input", str(corpus), "--output", str(out_txt), "--pattern", "**/*.txt")
    assert proc.returncode == 0, proc.stderr
    txt = [files["a.txt"], files["b.txt"], files["nested/c.txt"]]
    tf = TokenFile(out_txt)
    assert len(tf) == sum(len(t.encode()) + 1 for t in txt)
    assert tok.decode(tf.tokens.tolist()) == "".join(txt)


@pytest.mark.fast
def test_prepare_data_tool_rejects_missing_arguments(tmp_path):
    proc = _prepare("--input", str(tmp_path))
    assert proc.returncode != 0
    assert "--output" in proc.stderr


# --- stdlib corpus ------------------------------------------------------------------------------------

def test_stdlib_token_file_is_built_once_and_cached(tmp_path):
    tok = ByteTokenizer()
    max_bytes = 200_000
    tf = stdlib_token_file(tok, tmp_path, max_bytes)
    assert tf.path.parent == tmp_path
    built = tf.path.stat().st_mtime_ns, tf.path.with_suffix(".json").stat().st_mtime_ns
    assert len(tf) >= max_bytes  # the last file read crosses max_bytes; each byte is a token

    again = stdlib_token_file(tok, tmp_path, max_bytes)
    assert again.path == tf.path
    assert (again.path.stat().st_mtime_ns, again.path.with_suffix(".json").stat().st_mtime_ns) == built
    assert np.array_equal(again.tokens, tf.tokens)
    assert len(list(tmp_path.iterdir())) == 2

    # The first document is the first standard-library module, in sorted order.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    first = next(text_files(stdlib, "*.py"))
    eos = np.flatnonzero(tf.tokens == tok.eos_id)
    assert tok.decode(tf.tokens[: eos[0]].tolist()) == first
    compile(first, "<stdlib>", "exec")  # it is Python source
    text = tok.decode(tf.tokens[:5000].tolist())
    assert "def " in text or "import " in text

    # Another size is another cache entry.
    other = stdlib_token_file(tok, tmp_path, 50_000)
    assert other.path != tf.path and len(other) < len(tf)


# --- sampler --------------------------------------------------------------------------------------------

SEQ = 8


def _tokens(num_windows: int, seed: int = 0) -> np.ndarray:
    """Random tokens for exactly num_windows windows of SEQ + 1 tokens (consecutive windows share one)."""
    return np.random.default_rng(seed).integers(0, 257, size=num_windows * SEQ + 1).astype(np.uint16)


def _sampler(tokens, global_batch=8, micro=2, dp_rank=0, dp_size=1, seed=0) -> StepSampler:
    return StepSampler(tokens, BatchSpec(global_batch, micro, SEQ, dp_rank, dp_size), seed)


def test_batch_spec_sizes():
    spec = BatchSpec(global_batch_size=16, micro_batch_size=2, seq_len=SEQ, dp_rank=1, dp_size=4)
    assert spec.local_batch_size == 4 and spec.num_micro_batches == 2


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_dp_slices_concatenate_to_the_single_process_batch(dp_size):
    tokens = _tokens(50)
    single = _sampler(tokens, global_batch=8)
    ranks = [_sampler(tokens, global_batch=8, micro=1, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in range(1, 16):  # 15 steps of 8 windows: more than two epochs of 50
        parts = [s.window_ids(step) for s in ranks]
        assert all(len(p) == 8 // dp_size for p in parts)
        assert [w for p in parts for w in p] == single.window_ids(step)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_micro_batches_are_windows_and_shifted_targets(dp_size):
    tokens = _tokens(40)
    for rank in range(dp_size):
        sampler = _sampler(tokens, global_batch=8, micro=2, dp_rank=rank, dp_size=dp_size)
        for step in (1, 3, 7):
            ids = sampler.window_ids(step)
            mbs = sampler.micro_batches(step)
            assert len(mbs) == (8 // dp_size) // 2 == sampler.spec.num_micro_batches
            rows = 0
            for inputs, targets in mbs:
                assert inputs.shape == targets.shape == (2, SEQ)
                assert inputs.dtype == targets.dtype == torch.int64
                assert torch.equal(inputs[:, 1:], targets[:, :-1])
                for i in range(2):
                    w = ids[rows + i]
                    window = torch.from_numpy(tokens[w * SEQ : w * SEQ + SEQ + 1].astype(np.int64))
                    assert torch.equal(inputs[i], window[:-1]) and torch.equal(targets[i], window[1:])
                rows += 2
            assert rows == len(ids)


@pytest.mark.fast
def test_same_seed_and_step_give_same_ids_in_any_order():
    tokens = _tokens(30)
    a, b = _sampler(tokens, seed=3), _sampler(tokens, seed=3)
    forward = [a.window_ids(s) for s in range(1, 12)]
    backward = [b.window_ids(s) for s in range(11, 0, -1)][::-1]  # resuming needs only the step
    assert forward == backward
    assert _sampler(tokens, seed=3).window_ids(9) == forward[8]
    other = [_sampler(tokens, seed=4).window_ids(s) for s in range(1, 12)]
    assert other != forward
    assert other[0] != forward[0]


def test_resumed_position_continues_the_stream_at_another_batch_size_and_dp_degree():
    """A checkpoint stores samples_seen; resuming with another global batch and dp degree reads on
    from exactly there: no sequence skipped, none repeated."""
    tokens = _tokens(50)
    before = _sampler(tokens, global_batch=8)
    stream = [w for step in range(1, 13) for w in before.window_ids(step)]  # 96 windows, two epochs
    seen = before.samples_seen(5)
    assert seen == 40
    ranks = [StepSampler(tokens, BatchSpec(16, 2, SEQ, r, 4), seed=0, offset=seen - 5 * 16) for r in range(4)]
    for step in (6, 7, 8):  # the resumed run counts on from step 5 with batches of 16 over 4 ranks
        resumed = [w for sampler in ranks for w in sampler.window_ids(step)]
        first = seen + (step - 6) * 16
        assert resumed == stream[first : first + 16]
    assert ranks[0].samples_seen(8) == seen + 3 * 16


def test_each_epoch_is_a_permutation_and_epochs_differ():
    num_windows, batch = 10, 4  # an epoch is 2.5 steps: steps 3, 5 and 8 straddle a boundary
    sampler = _sampler(_tokens(num_windows), global_batch=batch, micro=1)
    assert sampler.num_windows == num_windows
    stream = [w for step in range(1, 11) for w in sampler.window_ids(step)]
    epochs = [stream[i : i + num_windows] for i in range(0, len(stream), num_windows)]
    assert len(epochs) == 4
    for epoch in epochs:
        assert sorted(epoch) == list(range(num_windows))  # no window repeats within an epoch
    assert len({tuple(e) for e in epochs}) == len(epochs)  # a fresh order each epoch


def test_windows_cover_the_corpus_without_running_off_the_end():
    tokens = _tokens(12)
    extra = np.concatenate([tokens, tokens[:SEQ - 1]])  # fewer than SEQ extra tokens: no extra window
    for toks in (tokens, extra):
        sampler = _sampler(toks, global_batch=4, micro=4)
        assert sampler.num_windows == 12
        seen = set()
        for step in range(1, 4):
            for inputs, _ in sampler.micro_batches(step):
                assert inputs.shape == (4, SEQ)
            seen.update(sampler.window_ids(step))
        assert seen == set(range(12))


def test_too_little_data_raises():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        _sampler(_tokens(7), global_batch=8)
    _sampler(_tokens(8), global_batch=8)  # exactly one batch is enough
