"""checkpoint.init_from=HF_DIR alone: config.json defines the model, the folder the tokenizer
(parallel3d/config/hf_folder.py, parallel3d/data/tokenizer.py). In-process: composition and model
building only, no training run (tests/test_hf_export.py trains from these folders)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from harness.hf_files import tiny_qwen3, token_batch
from omegaconf import OmegaConf

from parallel3d.base import ConfigError
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.state import TrainState
from parallel3d.config.compose import compose, user_set_keys
from parallel3d.config.schema import CheckpointConfig, ModelConfig
from parallel3d.data.tokenizer import HFTokenizer, load_tokenizer, tokenizer_hash
from parallel3d.models import Transformer
from parallel3d.planner import predict

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_config")
    return {"qwen3": tiny_qwen3(root / "qwen3"), "qwen3_moe": tiny_qwen3(root / "qwen3_moe", moe=True, seed=1)}


def built(cfg) -> Transformer:
    """Our model as checkpoint.init_from builds it: the composed model config, the folder's weights."""
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model))
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)
    path = Path(cfg.checkpoint.init_from)
    Checkpointer(path, CheckpointConfig()).load_weights(path, TrainState([model]), model_cfg)
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_the_folder_alone_defines_model_and_tokenizer(folders, family):
    """No model.* key: the composed config is the folder's model, its logits are transformers'."""
    folder = folders[family]
    cfg = compose([f"checkpoint.init_from={folder}"])
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size) == (64, 2, 4, 2, 32, 320)
    assert (m.rope_theta, m.norm_eps, m.max_seq_len, m.qk_norm, m.tie_embeddings) == (1e6, 1e-6, 256, True,
                                                                                     family == "qwen3")
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_dim) == ((4, 2, 32) if family == "qwen3_moe" else
                                                                      (0, m.moe.top_k, m.moe.expert_ffn_dim))
    assert cfg.data.tokenizer == str(folder) and m.name == family
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = token_batch(320)
    with torch.no_grad():
        torch.testing.assert_close(built(cfg)(batch), theirs(batch).logits, rtol=1e-5, atol=1e-5)
    planned = predict(cfg, 1).model_state_bytes["param_bytes"]  # the planner sees the folder's model too
    assert planned == 4 * sum(p.numel() for p in theirs.parameters())


@pytest.mark.fast
def test_a_set_key_that_disagrees_is_refused_naming_both_values(folders, tmp_path, monkeypatch):
    folder = folders["qwen3"]
    with pytest.raises(ConfigError, match=r"its config.json has rope_theta=1000000.0 but model.rope_theta=500000.0 "
                                          r"was set. Fix: drop model.rope_theta"):
        compose([f"checkpoint.init_from={folder}", "model.rope_theta=500000"])
    agreeing = compose([f"checkpoint.init_from={folder}", "model.rope_theta=1e6", "model.head_dim=32",
                        f"data.tokenizer={folder / 'tokenizer.json'}", "model.activation_checkpoint=full"])
    assert agreeing.model.activation_checkpoint == "full"  # keys that change no number stay the user's
    with pytest.raises(ConfigError, match=r"its tokenizer is .*tokenizer.json but data.tokenizer=byte was set"):
        compose([f"checkpoint.init_from={folder}", "data.tokenizer=byte"])
    with pytest.raises(ConfigError, match=r"hidden_size=64 but model.dim=4096 was set"):
        compose([f"checkpoint.init_from={folder}", "model=llama3_8b"])  # a model group chosen: all its keys
    (tmp_path / "mine.yaml").write_text("recipe: mine\nmodel:\n  norm_eps: 1.0e-5\n")  # a recipe's own values count
    monkeypatch.setenv("PARALLEL3D_RECIPES", str(tmp_path))
    assert user_set_keys(["recipe=mine", "train.steps=3"]) == {"model.norm_eps"}
    with pytest.raises(ConfigError, match=r"rms_norm_eps=1e-06 but model.norm_eps=1e-05 was set"):
        compose(["recipe=mine", f"checkpoint.init_from={folder}"])


def test_another_attention_than_the_folders_is_refused(folders, tmp_path):
    """model.attention=mla beside a Llama-family folder disagrees with it, as any model key does."""
    folder = shutil.copytree(folders["qwen3"], tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "llama"}))
    with pytest.raises(ConfigError, match=r"^checkpoint\.init_from=.*: its config.json has model_type=llama, so "
                                          r"attention=gqa but model.attention=mla was set. Fix: drop model.attention"):
        compose([f"checkpoint.init_from={folder}", "model.attention=mla"])
    assert compose([f"checkpoint.init_from={folder}", "model.attention=gqa"]).model.attention == "gqa"


UNSUPPORTED = {
    "attention_bias": ({"attention_bias": True}, "attention_bias=true"),
    "sliding_window": ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
    "rope": ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e6}}, "rope type dynamic"),
    "family": ({"model_type": "gpt2"}, "model_type=gpt2"),
}


@pytest.mark.parametrize("case", UNSUPPORTED)
def test_a_field_the_model_cannot_honour_is_refused(folders, tmp_path, case):
    folder = shutil.copytree(folders["qwen3"], tmp_path / "copy")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | UNSUPPORTED[case][0]))
    with pytest.raises(ConfigError, match=r"^checkpoint.init_from=.*" + UNSUPPORTED[case][1]) as e:
        compose([f"checkpoint.init_from={folder}"])
    assert "\n" not in str(e.value)


@pytest.mark.fast
def test_llama3_rope_scaling_is_read(folders, tmp_path):
    folder = shutil.copytree(folders["qwen3"], tmp_path / "llama")
    config = json.loads((folder / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    config = {**config, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": scaling}
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rope_parameters"}))
    m = compose([f"checkpoint.init_from={folder}"]).model
    assert (m.rope_theta, m.qk_norm, m.rope_scaling.factor, m.rope_scaling.original_max_seq_len) == (5e5, False, 8, 64)


def test_tokenizer_folder_declares_its_special_tokens(folders, tmp_path):
    """eos/pad from tokenizer_config.json (Qwen3 instruct: <|im_end|>), bos declared none; a bare
    tokenizer.json falls back to the well-known names and keeps the hash it always had."""
    folder = folders["qwen3"]
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer)
    assert (tok.token(tok.eos_id), tok.bos_id, tok.token(tok.pad_id)) == ("<|im_end|>", None, "<|endoftext|>")
    bare = load_tokenizer(str(folder / "tokenizer.json"))
    assert (bare.token(bare.eos_id), bare.pad_id) == ("<|endoftext|>", None)
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copyfile(folder / "tokenizer.json", plain / "tokenizer.json")
    assert tokenizer_hash(str(plain)) == tokenizer_hash(str(folder / "tokenizer.json")) == tokenizer_hash(
        str(plain / "tokenizer.json"))
    assert tokenizer_hash(str(folder)) != tokenizer_hash(str(plain))  # its tokenizer_config.json changes eos
    llama = tiny_qwen3(tmp_path / "llama", eos="<|endoftext|>")
    config = json.loads((llama / "tokenizer_config.json").read_text())
    (llama / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": "<|im_start|>"}))
    tok = load_tokenizer(str(llama))
    assert (tok.token(tok.bos_id), tok.token(tok.eos_id)) == ("<|im_start|>", "<|endoftext|>")


SIZING = {  # config.json field: a value no machine holds
    "num_hidden_layers": 10**9,
    "hidden_size": 2**24,
    "vocab_size": 10**12,
    "intermediate_size": 10**12,
}


@pytest.mark.parametrize("field", SIZING)
def test_a_config_too_large_to_build_is_refused_before_anything_is_built(folders, tmp_path, field, monkeypatch):
    """The parameter count comes from config.json alone (one block of each kind on the meta
    device): 10^9 layers are refused in one line naming the folder, the field and the estimate,
    without building the model layer by layer."""
    import time

    from parallel3d.models import llama
    from parallel3d.validate import check

    folder = shutil.copytree(folders["qwen3"], tmp_path / "copy")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {field: SIZING[field]}))
    monkeypatch.setattr(llama.Transformer, "__init__", lambda *a, **k: pytest.fail("the model was built"))
    start = time.process_time()
    with pytest.raises(ConfigError, match=rf"^checkpoint.init_from={folder}: its config.json has {field}="
                                          rf"{SIZING[field]}: a model of .* parameters, at least .* GiB of model "
                                          r"state a rank \(16 bytes a parameter over 2 ranks\), more than the .* GiB "
                                          rf"a rank has. Fix: check {field} in {folder}/config.json") as e:
        check(compose([f"checkpoint.init_from={folder}", "train.steps=4", "optim.warmup_steps=1"]), 2)
    assert "\n" not in str(e.value) and time.process_time() - start < 10
    check(compose([f"checkpoint.init_from={folders['qwen3']}", "train.steps=4", "optim.warmup_steps=1"]), 2)
