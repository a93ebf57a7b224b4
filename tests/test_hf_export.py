"""A complete Hugging Face folder out (parallel3d/hf/export.py), from a run that started from one
in (parallel3d/config/hf_folder.py). One launch trains the tiny Qwen3 and Qwen3-MoE folders of
tests/harness/hf_files.py (the MoE one in several files with an index) for 4 steps without any model.*
key and with train.save_model=true; the run_dir/hf/ it writes loads in transformers with our
logits, generates until EOS, and equals what parallel3d-convert-hf exports from the checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from harness.hf_files import TEXT, tiny_qwen3, token_batch
from harness.runs import FAST, launch_batch
from safetensors.torch import load_file, save_file

from parallel3d.checkpoint.checkpointer import Checkpointer

from parallel3d.checkpoint.state import TrainState
from parallel3d.cli import convert_hf
from parallel3d.config.schema import CheckpointConfig
from parallel3d.data.tokenizer import load_tokenizer
from parallel3d.models import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
FAMILIES = ("qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def trained(runs_root):
    """{family: (input folder, run_dir)}: 4 steps from each folder, in one launch."""
    root = runs_root / "hf_export"
    folders = {"qwen3": tiny_qwen3(root / "in-qwen3"),
               "qwen3_moe": tiny_qwen3(root / "in-qwen3_moe", moe=True, seed=1, max_shard_size="40KB")}
    assert (folders["qwen3_moe"] / "model.safetensors.index.json").is_file()
    runs = launch_batch(root, {family: [*FAST, "train.steps=4", "optim.warmup_steps=1", "data.max_bytes=100000",
                                        "checkpoint.every=4", "train.save_model=true", f"checkpoint.init_from={folder}"]
                               for family, folder in folders.items()}, nproc=1)
    assert sorted(runs) == sorted(FAMILIES), "a run failed: see its run_dir/logs"
    return {family: (folders[family], runs[family]) for family in FAMILIES}


def ours(run_dir) -> Transformer:
    """The trained model as the run's last checkpoint holds it."""
    model_cfg = convert_hf.model_config(run_dir / "checkpoints" / "step_4")
    with torch.device("meta"):
        model = Transformer(model_cfg)
    model.to_empty(device="cpu")
    model.init_weights(0)  # the buffers (RoPE tables); the checkpoint then gives every parameter
    Checkpointer(run_dir, CheckpointConfig()).load(run_dir / "checkpoints" / "step_4", TrainState([model]))
    return model.eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_folder_is_the_trained_model_in_transformers(trained, family):
    folder, run = trained[family]
    run.assert_finished(4)
    assert f"parallel3d: model {family} " in run.stdout and f"from {folder}, tokenizer {folder}" in run.stdout
    out = run.run_dir / "hf"
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    batch = token_batch(320)
    with torch.no_grad():
        logits = ours(run.run_dir)(batch)
        torch.testing.assert_close(theirs(batch).logits, logits, rtol=1e-5, atol=1e-5)
        assert (start(batch).logits - logits).abs().max() > 1e-2  # trained: not the folder it started from
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert [tokenizer.encode(t, add_special_tokens=False) for t in TEXT] == [load_tokenizer(str(folder)).encode(t)
                                                                             for t in TEXT]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert theirs.config.eos_token_id == theirs.generation_config.eos_token_id == tokenizer.eos_token_id == eos


def make_eos_greedy_at(out, prompt: torch.Tensor, eos: int) -> int:
    """Swap the output rows of EOS and of the greedy token at some step k (one that neither the
    prompt nor the steps before hold): greedy decoding then emits EOS at step k. Returns k."""
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    free = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
    k = next(k for k in [*range(1, 6), 0] if free[k] != eos and free[k] not in [*prompt[0].tolist(), *free[:k]])
    path = out / "model.safetensors"
    weights = load_file(str(path))
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    weights[head][[eos, free[k]]] = weights[head][[free[k], eos]]  # tied: rows no input before step k uses
    save_file(weights, str(path), metadata={"format": "pt"})
    return k


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_stops_at_eos(trained, family, tmp_path):
    out = shutil.copytree(trained[family][1].run_dir / "hf", tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("import os", return_tensors="pt")["input_ids"]  # no EOS in it (a chat turn ends with one)
    k = make_eos_greedy_at(out, prompt, tokenizer.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert len(generated) == k + 1 and generated[-1] == tokenizer.eos_token_id  # stopped at EOS, by its config


def test_convert_hf_export_equals_the_saved_folder(trained, tmp_path):
    run_dir, out = trained["qwen3_moe"][1].run_dir, tmp_path / "export"
    assert convert_hf.main(["export", str(run_dir), str(out), "--dtype", "float32"]) == 0
    saved = run_dir / "hf"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in saved.iterdir())
    for path in saved.iterdir():
        if path.suffix == ".safetensors":
            a, b = load_file(str(path)), load_file(str(out / path.name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        elif path.suffix == ".json":
            assert json.loads(path.read_text()) == json.loads((out / path.name).read_text()), path.name
        else:
            assert path.read_bytes() == (out / path.name).read_bytes(), path.name


def test_tokenizer_files_out(tmp_path):
    """A folder whose template ends turns with another token than eos stops generation at both; a
    bare tokenizer.json gets a tokenizer_config.json that AutoTokenizer reads with its eos."""
    from harness.hf_files import tiny_tokenizer

    from parallel3d.hf.export import generation_config, token_ids, write_tokenizer

    source = tiny_tokenizer(tmp_path / "base", eos="<|endoftext|>")  # Qwen3 base: eos <|endoftext|>
    for name, spec in {"folder": source, "bare": source / "tokenizer.json"}.items():
        (tmp_path / name).mkdir()
        write_tokenizer(tmp_path / name, str(spec), model_max_length=64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "folder")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")]
    assert generation_config(tmp_path / "folder", token_ids(tmp_path / "folder"))["eos_token_id"] == ids
    bare = transformers.AutoTokenizer.from_pretrained(tmp_path / "bare")
    assert (bare.eos_token, bare.eos_token_id, bare.model_max_length) == ("<|endoftext|>", ids[0], 64)
    assert bare.encode(TEXT[0], add_special_tokens=False) == tokenizer.encode(TEXT[0], add_special_tokens=False)
    # The template of the file's folder comes along: instruction data rendered with it.
    assert generation_config(tmp_path / "bare", token_ids(tmp_path / "bare"))["eos_token_id"] == ids
    assert bare.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    (tmp_path / "alone").mkdir()  # a tokenizer.json with no template beside it
    shutil.copyfile(source / "tokenizer.json", tmp_path / "alone" / "tokenizer.json")
    (tmp_path / "alone-out").mkdir()
    write_tokenizer(tmp_path / "alone-out", str(tmp_path / "alone" / "tokenizer.json"), model_max_length=64)
    assert generation_config(tmp_path / "alone-out", token_ids(tmp_path / "alone-out"))["eos_token_id"] == ids[0]
    # data.chat_template=FILE: the run's own template replaces the folder's in the export.
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    (tmp_path / "own-out").mkdir()
    write_tokenizer(tmp_path / "own-out", str(source), model_max_length=64, chat_template=str(own))
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path / "own-out")
    assert exported.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>hi<|im_end|>"
