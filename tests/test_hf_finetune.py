"""Fine-tuning straight from Hugging Face folders, as a user starts it: ``checkpoint.init_from=HF_DIR``
and chat records, nothing else about the model. LoRA from a Llama-3-style folder (its own tokenizer,
chat template, BOS and ``<|eot_id|>``), from a Qwen3-MoE folder and from a DeepSeek-V3 folder, and full fine-tuning of Qwen3
and Qwen3-MoE under tensor parallelism (their per-head q/k norms replicated over tp): every layout
equals one process (losses, grad norms, final weights and adapters within the tolerance the
one-process run's own sensitivity implies: tests/harness/tolerance.py).

All runs train in three launches: the one-process references (and their twins) together, the
4-rank layouts in batches of 8 (conftest ``Parity.prefetch``)."""

from __future__ import annotations

import json

import pytest
from harness.chat_files import chat_records, llama_folder, write_jsonl
from harness.hf_files import tiny_deepseek_v3, tiny_qwen3
from harness.parity import assert_matches, layouts, selected_params

# optim.eps=1e-5 (conftest's FAST has 1e-6): B starts at zero, so A's first gradient comes at step 2,
# proportional to a B that has moved by about lr, and AdamW's first update is near lr * sign(g) for
# every element with |g| well above eps. An element whose gradient nearly cancels (here 6e-7 among
# typical 3e-4, one of Qwen3-MoE's k_proj A) then moves by up to lr in a direction float32 round-off
# picks: 8.5e-5 apart between layouts whose losses agreed to 1e-6. With eps=1e-5 an element's update
# changes by at most lr / eps times its gradient's round-off: the one-process run is far less
# sensitive, and so is the tolerance it implies.
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.eps=1e-5"]
LAYOUTS = layouts({
    "dp2_tp2": (4, ["parallel.dp_shard=2", "parallel.tp=2"]),
    "dp2_pp2": (4, ["parallel.dp_shard=2", "parallel.pp=2"]),
    "dp2_cp2": (4, ["parallel.dp_shard=2", "parallel.cp=2"]),
    "zero3": (4, ["parallel.dp_shard=4", "parallel.zero_stage=3", "train.micro_batch_size=2"]),
})
# (folder, LoRA or a full fine-tune, layout): run name -> its layout.
LORA_RUNS = {f"{folder}-lora-{layout.name}": (folder, True, layout) for folder in ("llama3", "qwen3_moe")
             for layout in LAYOUTS}
# Multi-head latent attention's projections take adapters too (wq_a and wkv_a replicated over tp).
LORA_RUNS["deepseek_v3-lora-dp2_tp2"] = ("deepseek_v3", True, LAYOUTS[0])
TP_RUNS = {f"{folder}-full-dp2_tp2": (folder, False, LAYOUTS[0]) for folder in ("qwen3", "qwen3_moe")}
ONE_PROCESS = ["train.micro_batch_size=16"]


@pytest.fixture(scope="module")
def folders(runs_root):
    root = runs_root / "hf_finetune"
    found = {"llama3": llama_folder(root / "llama3"), "qwen3": tiny_qwen3(root / "qwen3"),
             "qwen3_moe": tiny_qwen3(root / "qwen3_moe", moe=True, seed=1),
             "deepseek_v3": tiny_deepseek_v3(root / "deepseek_v3")}
    return found | {"chats": write_jsonl(root / "chats.jsonl", chat_records(200)), "cache": root / "cache"}


def overrides(folders, folder: str, lora: bool) -> list[str]:
    return [f"checkpoint.init_from={folders[folder]}", "data.format=chat", f"data.sources=[{folders['chats']}]",
            f"data.cache_dir={folders['cache']}", *(LORA if lora else [])]


def reference_name(folder: str, lora: bool) -> str:
    return f"{folder}-{'lora' if lora else 'full'}-one"


@pytest.fixture(scope="module")
def trained(request, parity, folders):
    """Every selected run and the one-process runs they are compared with, in one launch per rank count."""
    wanted = {name: spec for name, spec in (LORA_RUNS | TP_RUNS).items() if name in selected_params(request, "name")}
    runs = {name: (layout.nproc, [*overrides(folders, folder, lora), *layout.overrides])
            for name, (folder, lora, layout) in wanted.items()}
    # the one-process runs with their twins (tests/harness/tolerance.py)
    parity.prefetch_references({reference_name(folder, lora): [*overrides(folders, folder, lora), *ONE_PROCESS]
                                for folder, lora, _ in wanted.values()})
    parity.prefetch(runs)
    return parity


def check_layout(trained, folders, name: str, spec) -> None:
    folder, lora, layout = spec
    reference, tolerance = trained.measured(reference_name(folder, lora), [*overrides(folders, folder, lora),
                                                                         *ONE_PROCESS])
    run = trained.run(name, layout.nproc, [*overrides(folders, folder, lora), *layout.overrides])
    assert_matches(reference, run, tolerance=tolerance, weights=True)
    if lora:  # adapters trained and exported; the base folder's weights, merged, came back
        config = json.loads((run.run_dir / "hf_adapter" / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(folders[folder])


@pytest.mark.multirank
@pytest.mark.parametrize("name", LORA_RUNS)
def test_lora_from_a_folder_equals_one_process(trained, folders, name):
    check_layout(trained, folders, name, LORA_RUNS[name])


@pytest.mark.multirank
@pytest.mark.parametrize("name", TP_RUNS)
def test_qwen3_under_tensor_parallelism_equals_one_process(trained, folders, name):
    """Full fine-tuning: the q/k norms train, their gradients summed over the tp ranks' heads."""
    check_layout(trained, folders, name, TP_RUNS[name])


def test_lora_starts_from_the_folder_with_fresh_adapters(tmp_path):
    """In-process: the folder's weights load under LoRA (no adapter looked up in it), the adapters
    are those of any fresh LoRA run of the seed (A drawn, B zero), so the model computes the folder's
    logits, transformers' own."""
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from parallel3d.checkpoint.checkpointer import Checkpointer

    from parallel3d.checkpoint.state import TrainState
    from parallel3d.config.compose import compose
    from parallel3d.config.schema import CheckpointConfig, ModelConfig
    from parallel3d.models import Transformer
    from parallel3d.models.lora import apply_lora, is_adapter

    folder = llama_folder(tmp_path / "llama3")
    cfg = compose([f"checkpoint.init_from={folder}", *LORA])
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model))
    with torch.device("meta"):
        model = Transformer(model_cfg)
    apply_lora(model, model_cfg.lora)
    model.to_empty(device="cpu")
    model.init_weights(cfg.train.seed)
    fresh = {name: p.detach().clone() for name, p in model.named_parameters() if is_adapter(name)}
    Checkpointer(folder, CheckpointConfig()).load_weights(folder, TrainState([model]), model_cfg)
    adapters = {name: p for name, p in model.named_parameters() if is_adapter(name)}
    assert adapters.keys() == fresh.keys() and all(torch.equal(adapters[n], fresh[n]) for n in fresh)
    assert all(not p.any() for n, p in adapters.items() if n.endswith("lora_b"))
    batch = torch.randint(0, model_cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(batch).logits
        torch.testing.assert_close(model.eval()(batch), theirs, rtol=1e-5, atol=1e-5)


def test_the_lora_recipe_validates_from_a_folder(tmp_path):
    """recipe=sft_llama3_8b_lora checkpoint.init_from=HF_DIR data.sources=[...], as docs/finetune.md
    runs it on 8 GPUs: composed, validated and planned (no training) on a Llama-3-style folder."""
    from parallel3d.config.compose import compose
    from parallel3d.planner import predict
    from parallel3d.validate import check

    folder = llama_folder(tmp_path / "llama3")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 8192}))  # the recipe's 4096
    chats = write_jsonl(tmp_path / "chats.jsonl", chat_records(20))
    cfg = check(compose(["recipe=sft_llama3_8b_lora", f"checkpoint.init_from={folder}", f"data.sources=[{chats}]"]),
                8, device="cuda")
    assert (cfg.model.name, cfg.model.dim, cfg.model.lora.rank, cfg.data.tokenizer) == ("llama3", 64, 16, str(folder))
    state = predict(cfg, 8).model_state_bytes
    assert 0 < state["grad_bytes"] < state["param_bytes"]  # the frozen base has no gradient
