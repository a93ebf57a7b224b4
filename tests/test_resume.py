"""Choosing the checkpoint to resume: checked files, the fallback, the config diff, the schedule."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from parallel3d.base import ConfigError, RunError
from parallel3d.checkpoint.resume import check_not_past_end, config_changes, pick_checkpoint
from parallel3d.checkpoint.verify import check_hf_weights, checkpoint_problem
from parallel3d.config.schema import OptimConfig
from parallel3d.optim.schedule import build_lr_scheduler, lr_factor, set_schedule_step


def fake_checkpoint(root, step: int, model_only: bool = False):
    path = root / f"step_{step}"
    (path / "rng").mkdir(parents=True)
    save_file({"w": torch.ones(4)}, str(path / "shard-00001.safetensors"))
    (path / "meta.json").write_text(json.dumps({"step": step, "model_only": model_only}))
    (path / "COMPLETE").write_text("")
    return path


@pytest.mark.fast
def test_corrupt_files_are_found_and_auto_resume_falls_back(tmp_path, capsys):
    good, newest = fake_checkpoint(tmp_path, 2), fake_checkpoint(tmp_path, 4)
    assert checkpoint_problem(good) is None
    (newest / "meta.json").write_text('{"step": 4, "mod')
    assert "meta.json is unreadable" in checkpoint_problem(newest)
    assert pick_checkpoint(tmp_path, "auto", announce=True) == good
    assert f"skipping corrupt checkpoint {newest}" in capsys.readouterr().err
    shard = good / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    assert "is truncated" in checkpoint_problem(good) or "header says" in checkpoint_problem(good)
    with pytest.raises(RunError, match=f"every checkpoint in {tmp_path} is corrupt .*resume=none"):
        pick_checkpoint(tmp_path, "auto", announce=False)
    assert pick_checkpoint(tmp_path / "nothing", "auto", announce=False) is None
    with pytest.raises(RunError, match=f"checkpoint.resume={good}: .*shard-00001.safetensors.*Fix"):
        pick_checkpoint(tmp_path, str(good), announce=False)


def test_a_checkpoint_past_train_steps_is_refused(tmp_path):
    path = fake_checkpoint(tmp_path, 8)
    assert check_not_past_end(path, 8) == 8
    with pytest.raises(RunError, match="at step 8, past train.steps=5.*Fix: set train.steps above 8"):
        check_not_past_end(path, 5)
    assert check_not_past_end(fake_checkpoint(tmp_path, 9, model_only=True), 5) == 0


@pytest.mark.fast
def test_config_changes_name_each_key():
    old = "optim:\n  lr: 0.003\ntrain:\n  steps: 4\nrun_dir: /a\n"
    new = "optim:\n  lr: 0.001\ntrain:\n  steps: 4\n  seed: 1\nrun_dir: /b\n"
    assert config_changes(old, new) == ["optim.lr 0.003 -> 0.001", "train.seed (unset) -> 1"]


def test_the_schedule_is_a_pure_function_of_step_and_config():
    """A scheduler set to step 6 of a new config gives that config's lr, whatever it was built at."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=3e-3)
    scheduler = build_lr_scheduler(optimizer, OptimConfig(lr=3e-3, warmup_steps=2), steps=8)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    set_schedule_step(scheduler, 6)
    expected = 3e-3 * lr_factor(6, steps=8, warmup=2, schedule="cosine", min_ratio=0.1, decay_fraction=0.2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected) == scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(
        3e-3 * lr_factor(7, steps=8, warmup=2, schedule="cosine", min_ratio=0.1, decay_fraction=0.2))


def test_a_missing_hugging_face_shard_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(RunError, match="model-00002-of-00002.safetensors is missing. Fix: download"):
        check_hf_weights(tmp_path)


def _bpe_tokenizer(path, text: str):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text] * 10, trainer)
    tok.save(str(path))
    return path


def test_a_resume_with_another_tokenizer_is_refused_unless_allowed(tmp_path):
    from harness.runs import launch

    from parallel3d.checkpoint.resume import check_tokenizer
    from parallel3d.config.schema import DataConfig
    from parallel3d.data.tokenizer import tokenizer_hash

    common = ["train.seq_len=32", "train.global_batch_size=4", "optim.warmup_steps=1", "data.max_bytes=100000",
              f"data.cache_dir={tmp_path / 'cache'}"]
    run = launch(tmp_path / "run", [*common, "train.steps=2", "checkpoint.every=2"])
    run.assert_finished(2)
    step_2 = tmp_path / "run" / "checkpoints" / "step_2"
    assert json.loads((step_2 / "meta.json").read_text())["tokenizer"] == tokenizer_hash("byte") == "byte"
    other = str(_bpe_tokenizer(tmp_path / "tokenizer.json", "the quick brown fox jumps over the lazy dog"))
    refused = launch(tmp_path / "run", [*common, "train.steps=4", f"data.tokenizer={other}"])
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = [x for x in refused.stderr.splitlines() if "config error" in x]
    assert f"data.tokenizer={other}" in line and str(step_2) in line and "allow_tokenizer_change=true" in line, line
    # The same decision, allowed (a full resume then proceeds as any other).
    check_tokenizer(step_2, DataConfig(tokenizer=other, allow_tokenizer_change=True), announce=False)
    check_tokenizer(step_2, DataConfig(tokenizer="byte"), announce=False)
    # A checkpoint without the hash (an older version) is judged by the tokenizer file its config names.
    meta = json.loads((step_2 / "meta.json").read_text())
    del meta["tokenizer"]
    (step_2 / "meta.json").write_text(json.dumps(meta))
    edited = _bpe_tokenizer(tmp_path / "edited.json", "lorem ipsum dolor sit amet")
    config = (step_2 / "config.yaml").read_text().replace("tokenizer: byte", f"tokenizer: {other}")
    (step_2 / "config.yaml").write_text(config)
    check_tokenizer(step_2, DataConfig(tokenizer=other), announce=False)
    with pytest.raises(ConfigError, match="another tokenizer than the checkpoint's"):
        check_tokenizer(step_2, DataConfig(tokenizer=str(edited)), announce=False)


def test_validation_reads_a_saved_config_only_once_it_verifies(tmp_path):
    """A damaged config.yaml in the newest checkpoint is neither parsed raw nor taken for the
    user's mistake: validation judges the newest checkpoint whose config verifies, and the resume
    falls back past the damaged one, naming it."""
    from omegaconf import OmegaConf

    from parallel3d.checkpoint.checkpointer import Checkpointer
    from parallel3d.checkpoint.checks import check_checkpoint
    from parallel3d.checkpoint.state import TrainState
    from parallel3d.config.schema import CheckpointConfig, ModelConfig
    from parallel3d.models import Transformer

    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
    model, m = Transformer(cfg), OmegaConf.structured(cfg)
    saved_yaml = OmegaConf.to_yaml({"model": m})
    for step in (2, 4):
        Checkpointer(tmp_path, CheckpointConfig()).save(step, TrainState([model]), {"samples_seen": 0}, saved_yaml)
    root, ck = tmp_path / "checkpoints", CheckpointConfig()
    config = root / "step_4" / "config.yaml"
    for damaged in ("model: [\n", "", saved_yaml.replace("n_layers: 1", "n_layers: 7"), None):
        config.unlink(missing_ok=True)
        if damaged is not None:
            config.write_text(damaged)
        check_checkpoint(ck, m, tmp_path)  # no parser error, no advice to change the (right) model
        assert pick_checkpoint(root, "auto", announce=False) == root / "step_2"
    other = OmegaConf.structured(ModelConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                             vocab_size=64, max_seq_len=16))
    with pytest.raises(ConfigError, match="step_2 holds a model with model.n_layers=1, this run builds "
                                          "model.n_layers=3"):
        check_checkpoint(ck, other, tmp_path)  # the one that verifies is still judged
