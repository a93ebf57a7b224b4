"""Hugging Face interop: names, export with parallel3d-convert-hf, import with checkpoint.init_from.

Tiny models train 10 steps (untied, tied, and with Llama 3.1 RoPE scaling), are exported, and must
come back bit for bit through ``checkpoint.init_from`` and match ``transformers``' Llama to float32
rounding. Runs and exports are shared by the whole module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness.runs import FAST, STEPS, Run, env, launch, relative_error
from harness.store import RunStore
from omegaconf import OmegaConf
from harness.tolerance import ONE_PASS
from safetensors import safe_open
from safetensors.torch import load_file

from parallel3d.checkpoint.checkpointer import Checkpointer

from parallel3d.checkpoint.state import TrainState
from parallel3d.cli import convert_hf
from parallel3d.config.compose import compose
from parallel3d.config.schema import CheckpointConfig, ModelConfig
from parallel3d.hf import families
from parallel3d.models import Transformer

# In-process DCP loads (no process group) say so on every call; that is the intent here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
# The rotary-scaled model: Llama 3.1's config at the tiny model's sizes. A short original context
# makes the scaling change nearly every frequency at 64 tokens. (A null rope_scaling cannot be set
# from the command line, so the 8B config, which has one, is the starting point.)
TINY = ["model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=384",
        "model.vocab_size=512", "model.rope_theta=10000", "model.max_seq_len=2048"]
MODELS = {
    "untied": [],
    "tied": ["model.tie_embeddings=true"],
    "rope_scaled": ["model=llama3_8b", "model.name=tiny_rope", *TINY, "model.rope_scaling.original_max_seq_len=64"],
}




def model_config(overrides: list[str]) -> ModelConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), compose(overrides).model))


class Models:
    """Each tiny model trained once (checkpoint at step 10), exported once per (dtype, shard size).
    The models train together, in one launch of the session's run store (tests/harness/store.py):
    one start-up for the three; their run folders are read-only here (exports go to ``root``)."""

    def __init__(self, root: Path, store: RunStore):
        self.root, self.store, self.runs, self.exports = root, store, {}, {}
        root.mkdir(parents=True, exist_ok=True)

    def run(self, name: str) -> Run:
        if name not in self.runs:
            wanted = {n: (1, [*FAST, "checkpoint.every=10", *o]) for n, o in MODELS.items() if n not in self.runs}
            records = self.store.get(wanted)
            self.runs[name] = Run.from_record(records[name])
            self.runs[name].assert_finished(STEPS)
        return self.runs[name]

    def export(self, name: str, dtype: str = "float32", max_shard_size: str = "5GB") -> Path:
        key = (name, dtype, max_shard_size)
        if key not in self.exports:
            out = self.root / f"hf-{name}-{dtype}-{max_shard_size}"
            assert convert_hf.main(["export", str(self.run(name).run_dir), str(out), "--dtype", dtype,
                                    "--max-shard-size", max_shard_size]) == 0
            self.exports[key] = out
        return self.exports[key]

    def step_dir(self, name: str) -> Path:
        return self.run(name).run_dir / "checkpoints" / "step_10"


@pytest.fixture(scope="module")
def models(runs_root, run_store) -> Models:
    return Models(runs_root / "hf", run_store)


def fresh_model(cfg: ModelConfig, seed: int = 1) -> Transformer:
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.eval()


def from_checkpoint(models: Models, name: str) -> Transformer:
    """The trained model as our own checkpoint holds it."""
    cfg = convert_hf.model_config(models.step_dir(name))
    model = fresh_model(cfg)
    Checkpointer(models.root, CheckpointConfig()).load(models.step_dir(name), TrainState([model]))
    return model


def from_hf_dir(path: Path, cfg: ModelConfig) -> Transformer:
    """A model initialized from a Hugging Face folder, as ``checkpoint.init_from`` does it."""
    model = fresh_model(cfg)
    Checkpointer(path, CheckpointConfig()).load_weights(path, TrainState([model]), cfg)
    return model


def tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))


# -- names ------------------------------------------------------------------------------------

NAMED = {"untied": [], "tied": ["model.tie_embeddings=true"], "llama3_8b": ["model=llama3_8b"]}


@pytest.mark.fast
@pytest.mark.parametrize("name", NAMED)
def test_names_map_one_to_one(name):
    cfg = model_config(NAMED[name])
    with torch.device("meta"):
        names = [n for n, _ in Transformer(cfg).named_parameters()]
    hf_names = [families.to_hf(n) for n in names]
    assert len(set(hf_names)) == len(names)
    assert all(n.startswith(("model.", "lm_head.")) for n in hf_names)
    assert ("lm_head.weight" in hf_names) == (not cfg.tie_embeddings)


@pytest.mark.parametrize("name", NAMED)
def test_names_and_shapes_are_transformers_llama(name):
    """Our names, renamed, are exactly LlamaForCausalLM's parameters for the config.json we write."""
    import transformers
    cfg = model_config(NAMED[name])
    with torch.device("meta"):
        ours = Transformer(cfg)
        theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**families.hf_config(cfg, torch.bfloat16)))
    assert {families.to_hf(n): p.shape for n, p in ours.named_parameters()} == {
        n: p.shape for n, p in theirs.named_parameters()}


# -- export, then import ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_export_then_init_from_gives_identical_logits(models, name):
    trained = from_checkpoint(models, name)
    cfg = trained.cfg
    imported = from_hf_dir(models.export(name), cfg)
    assert not torch.equal(fresh_model(cfg).tok_embeddings.weight, trained.tok_embeddings.weight)
    for (key, a), (_, b) in zip(trained.named_parameters(), imported.named_parameters(), strict=True):
        assert torch.equal(a, b), key
    with torch.no_grad():
        assert torch.equal(imported(tokens(cfg)), trained(tokens(cfg)))


def test_export_folder(models):
    out = models.export("untied")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 4
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (None, 256, None)
    assert config["rope_scaling"] is None and config["torch_dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    assert keys == {families.to_hf(n) for n, _ in from_checkpoint(models, "untied").named_parameters()}  # no optimizer


def test_multi_file_export_has_a_complete_index(models):
    limit = 300_000
    out = models.export("untied", max_shard_size="300KB")
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 2 and files[0].name == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / convert_hf.INDEX).read_text())
    held = {}
    for path in files:
        tensors = load_file(str(path))
        assert path.stat().st_size <= limit + 10_000 or len(tensors) == 1  # + the header
        for key in tensors:
            assert key not in held, f"{key} in {held.get(key)} and {path.name}"
            held[key] = path.name
    assert index["weight_map"] == held  # every tensor exactly once, in the file that holds it
    whole = load_file(str(models.export("untied") / "model.safetensors"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    assert all(torch.equal(whole[k], v) for path in files for k, v in load_file(str(path)).items())
    cfg = convert_hf.model_config(models.step_dir("untied"))
    with torch.no_grad():
        assert torch.equal(from_hf_dir(out, cfg)(tokens(cfg)), from_checkpoint(models, "untied")(tokens(cfg)))


def test_export_streams_one_file_at_a_time(models, tmp_path, monkeypatch):
    """Each read loads one output file's tensors, never the model: the memory bound of the tool."""
    loads, load = [], convert_hf.dcp.load

    def recording_load(state_dict, **kwargs):
        loads.append({k: t.numel() * t.element_size() for k, t in state_dict.items()})
        return load(state_dict, **kwargs)

    monkeypatch.setattr(convert_hf.dcp, "load", recording_load)
    convert_hf.export(models.run("tied").run_dir, tmp_path / "out", torch.float32, 200_000)
    largest = max(size for sizes in loads for size in sizes.values())
    assert len(loads) == len(list((tmp_path / "out").glob("*.safetensors"))) > 2
    assert all(sum(sizes.values()) <= max(200_000, largest) for sizes in loads)
    assert sorted(k for sizes in loads for k in sizes) == sorted(n for n, _ in
                                                               from_checkpoint(models, "tied").named_parameters())


def test_command_line_default_is_bfloat16(models, tmp_path):
    out = tmp_path / "bf16"
    shim = Path(__file__).resolve().parent.parent / "tools" / "convert_hf.py"  # DESIGN.md's command: still works
    proc = subprocess.run([sys.executable, str(shim), "export", str(models.step_dir("untied")),
                           str(out)], capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 0, proc.stderr
    full = load_file(str(models.export("untied") / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    assert written.keys() == full.keys()
    assert all(torch.equal(written[k], v.to(torch.bfloat16)) for k, v in full.items())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_command_line_refuses_nothing_to_export_and_a_used_folder(models, tmp_path, capsys):
    assert convert_hf.main(["export", str(tmp_path), str(tmp_path / "out")]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    used = models.export("untied")  # already holds a model: a second export would mix files
    assert convert_hf.main(["export", str(models.step_dir("untied")), str(used)]) == 1
    assert "holds safetensors files already" in capsys.readouterr().err
    damaged = tmp_path / "damaged"  # a flipped byte in a shard: exported only what verifies
    shutil.copytree(models.step_dir("untied"), damaged / models.step_dir("untied").name)
    shard = next((damaged / models.step_dir("untied").name).glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert convert_hf.main(["export", str(shard.parent), str(tmp_path / "out2")]) == 1
    err = capsys.readouterr().err
    assert "does not verify" in err and shard.name in err, err
    assert not (tmp_path / "out2").exists()


def test_init_from_refuses_another_shape_naming_the_key(models, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(models.export("untied"), other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"num_hidden_layers=3 but model.n_layers=4"):
        from_hf_dir(other, convert_hf.model_config(models.step_dir("untied")))
    # The folder defines the model; a model key set on the command line must agree (before training starts).
    run = launch(tmp_path / "run", [*FAST, f"checkpoint.init_from={other}", "model.n_layers=4"])
    assert run.returncode == 2 and not run.metrics
    assert "config error" in run.stderr and "num_hidden_layers=3 but model.n_layers=4 was set" in run.stderr


@pytest.mark.multirank
def test_init_from_export_at_another_layout(models):
    """Two tensor-parallel ranks, each reading its slices of the export (several files and an
    index), start where one process does."""
    export = models.export("untied", max_shard_size="300KB")
    init = [*FAST, "train.steps=2", f"checkpoint.init_from={export}"]
    single = launch(models.root / "init-single", init)
    tp2 = launch(models.root / "init-tp2", [*init, "parallel.tp=2"], nproc=2)
    single.assert_finished(2)
    tp2.assert_finished(2)
    assert relative_error(tp2.losses[:1], single.losses[:1]) <= ONE_PASS  # the first step: one pass
    assert single.losses[0] < models.run("untied").losses[0] - 1.0  # trained weights, not a fresh init


def test_byte_run_exports_a_tokenizer_that_tokenizes_as_training_did(models):
    """A byte-tokenizer run's folder: AutoTokenizer gives ByteTokenizer's ids, 256 is its EOS."""
    import transformers
    from parallel3d.data.tokenizer import ByteTokenizer

    out = models.export("untied")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    texts = ["def f(x):\n\treturn x  ", "  über 世界 🙂", "", "a\r\nb"]
    assert [tokenizer.encode(t, add_special_tokens=False) for t in texts] == [ByteTokenizer().encode(t) for t in texts]
    assert tokenizer.decode(ByteTokenizer().encode(texts[1])) == texts[1]
    assert tokenizer.eos_token_id == 256 == json.loads((out / "generation_config.json").read_text())["eos_token_id"]


# -- transformers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_transformers_computes_our_logits(models, name, tmp_path):
    """Our export in LlamaForCausalLM: same logits; and what transformers saves, we load back exactly."""
    import transformers
    ours = from_checkpoint(models, name)
    theirs = transformers.LlamaForCausalLM.from_pretrained(models.export(name), dtype=torch.float32).eval()
    batch = tokens(ours.cfg)
    with torch.no_grad():
        expected = ours(batch)
        torch.testing.assert_close(theirs(batch).logits, expected, rtol=1e-5, atol=1e-5)
        theirs.save_pretrained(tmp_path / "saved")  # a folder as transformers writes it (its config keys)
        assert torch.equal(from_hf_dir(tmp_path / "saved", ours.cfg)(batch), expected)
        if ours.cfg.rope_scaling is not None:  # the scaling matters here: without it, other logits
            unscaled = fresh_model(ModelConfig(**{**vars(ours.cfg), "rope_scaling": None}))
            unscaled.load_state_dict(ours.state_dict())
            assert (unscaled(batch) - expected).abs().max() > 1e-3


# -- Qwen3, Qwen3-MoE, Mixtral --------------------------------------------------------------------

FAMILIES = {  # family: (transformers class, our model config at tiny sizes)
    "qwen3": ("Qwen3ForCausalLM", dict(qk_norm=True, head_dim=48, tie_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(qk_norm=True, head_dim=48, moe=dict(every=2, norm_topk_prob=False))),
    "mixtral": ("MixtralForCausalLM", dict(moe=dict(top_k=2))),
}


def family_config(name: str) -> ModelConfig:
    from parallel3d.config.schema import MoEConfig

    extra = dict(FAMILIES[name][1])
    moe = extra.pop("moe", None)
    moe = MoEConfig(**{"num_experts": 4, "top_k": 3, "expert_ffn_dim": 32, **moe}) if moe is not None else MoEConfig()
    # A wide init: decisive routing (no near-ties for float32 rounding to flip between implementations).
    return ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, init_std=0.2,
                       moe=moe, **extra)


@pytest.mark.parametrize("name", FAMILIES)
def test_families_export_to_transformers_and_back(name, tmp_path):
    """A random model of each family: its export is the transformers class with our logits
    (float32, 1e-5), the family's names and per-expert tensors; it imports back bit for bit, also
    from what transformers itself saves."""
    from dataclasses import asdict

    import transformers
    cfg = family_config(name)
    ours = fresh_model(cfg)
    ours.init_weights(seed=3)
    (tmp_path / "run").mkdir()
    yaml = OmegaConf.to_yaml({"model": asdict(cfg), "data": {"tokenizer": "byte"}})
    Checkpointer(tmp_path / "run", CheckpointConfig()).save(1, TrainState([ours]), {}, yaml)
    assert convert_hf.main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == [FAMILIES[name][0]] and config["model_type"] == name
    theirs = getattr(transformers, FAMILIES[name][0]).from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    batch = tokens(cfg)
    with torch.no_grad():
        expected = ours(batch)
        torch.testing.assert_close(theirs(batch).logits, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(from_hf_dir(tmp_path / "hf", cfg)(batch), expected)
        theirs.save_pretrained(tmp_path / "saved")
        assert torch.equal(from_hf_dir(tmp_path / "saved", cfg)(batch), expected)
    if cfg.moe.num_experts:
        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        prefix = "model.layers.1." + ("mlp.experts.3.down_proj" if name == "qwen3_moe" else "block_sparse_moe.experts.3.w2")
        assert f"{prefix}.weight" in keys
