"""Every bad configuration is refused before any process starts, with one message naming the key."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from harness.runs import env, refused_by_the_launcher

from parallel3d.base import ConfigError
from parallel3d.config.compose import compose
from parallel3d.validate import check

# (overrides, world size, key the message must name, words it must contain)
BAD = [
    (["parallel.dp_shard=3"], 4, "parallel.dp_shard", "world size is 4"),
    # one process cannot run a 3D recipe at any dp_shard: the fix is the launch
    (["recipe=tiny_cpu_3d"], 1, "parallel.dp_shard", "start 8 ranks: parallel3d-run --nproc-per-node 8"),
    (["parallel.dp_replicate=3"], 4, "parallel.dp_shard", "not divisible"),
    (["parallel.dp_shard=0"], 1, "parallel.dp_shard", "must be >= 1"),
    (["parallel.tp=0"], 1, "parallel.tp", ">= 1"),
    (["model.n_heads=3"], 1, "model.dim", "not divisible by model.n_heads"),
    (["model.dim=132", "model.n_heads=4", "model.n_kv_heads=4"], 1, "model.n_heads", "odd"),
    (["model.n_kv_heads=3"], 1, "model.n_kv_heads", "divide"),
    (["parallel.tp=8", "train.micro_batch_size=1"], 8, "parallel.tp", "model.n_heads=4"),
    (["parallel.tp=4", "train.micro_batch_size=1"], 4, "parallel.tp", "model.n_kv_heads=2"),
    (["parallel.tp=2", "model.ffn_dim=385", "train.micro_batch_size=1"], 2, "parallel.tp", "model.ffn_dim=385"),
    (["parallel.pp=8", "train.micro_batch_size=1"], 8, "parallel.pp", "model.n_layers=4"),
    (["train.global_batch_size=12"], 4, "train.global_batch_size", "data-parallel degree 4"),
    (["train.seq_len=4096"], 1, "train.seq_len", "max_seq_len=2048"),
    (["parallel.tp=2", "train.seq_len=63"], 2, "train.seq_len", "sequence parallelism"),
    (["parallel.zero_stage=4"], 2, "parallel.zero_stage", "ZeRO stages"),
    (["parallel.pp_schedule=Zigzag"], 1, "parallel.pp_schedule", "1F1B"),
    (["parallel.pp_microbatches=0"], 1, "parallel.pp_microbatches", ">= 1"),
    (["parallel.dp_replicate=2", "parallel.zero_stage=3"], 2, "parallel.zero_stage", "shards nothing"),
    (["parallel.fsdp_sharding_strategy=SHARD_EVERYTHING"], 2, "parallel.fsdp_sharding_strategy", "FULL_SHARD"),
    (["parallel.fsdp_sharding_strategy=HYBRID_SHARD"], 2, "parallel.fsdp_sharding_strategy", "dp_replicate"),
    (["parallel.fsdp_sharding_strategy=FULL_SHARD", "parallel.dp_replicate=2"], 4,
     "parallel.fsdp_sharding_strategy", "HYBRID_SHARD"),
    (["parallel.fsdp_wrap=layer"], 1, "parallel.fsdp_wrap", "block or size"),
    (["parallel.fsdp_prefetch=-1"], 1, "parallel.fsdp_prefetch", ">= 0"),
    (["checkpoint.verify=sha256"], 1, "checkpoint.verify", "checksum, size, none"),
    (["parallel.cp=0"], 1, "parallel.cp", ">= 1"),
    (["parallel.cp=2", "train.seq_len=66"], 2, "train.seq_len", "2*cp = 4 chunks"),
    (["parallel.cp=2", "parallel.tp=4", "model.n_kv_heads=4", "train.seq_len=12", "train.micro_batch_size=1"], 8,
     "train.seq_len", "sequence parallelism"),
    (["parallel.cp=8", "train.micro_batch_size=1"], 8, "parallel.cp", "4 attention heads"),
    (["parallel.cp=2", "parallel.tp=4", "model.n_kv_heads=4", "train.micro_batch_size=1"], 8, "parallel.cp",
     "cp_method=ring"),
    (["parallel.cp_method=ulysses"], 1, "parallel.cp_method", "alltoall, ring"),
    (["parallel.cp=3"], 4, "parallel.dp_shard", "dp_replicate*tp*pp*cp = 3"),
    (["parallel.fsdp_prefetch=1", "parallel.fsdp_wrap=size"], 1, "parallel.fsdp_prefetch", "fsdp_wrap=block"),
    (["parallel.cpu_offload=true", "parallel.zero_stage=0"], 2, "parallel.cpu_offload", "zero_stage 1, 2 or 3"),
    (["train.param_dtype=float8"], 1, "train.param_dtype", "bfloat16"),
    (["train.reduce_dtype=half"], 1, "train.reduce_dtype", "float32"),
    (["train.device=tpu"], 1, "train.device", "auto, cpu or cuda"),
    (["train.steps=0"], 1, "train.steps", ">= 1"),
    (["train.micro_batch_size=0"], 1, "train.micro_batch_size", ">= 1"),
    (["train.grad_clip=-1"], 1, "train.grad_clip", ">= 0"),
    (["train.dist_timeout_s=0"], 1, "train.dist_timeout_s", ">= 1"),
    (["train.on_bad_step=ignore"], 1, "train.on_bad_step", "stop, skip"),
    (["train.spike_factor=0.5"], 1, "train.spike_factor", "above 1"),
    (["train.max_bad_steps=0"], 1, "train.max_bad_steps", ">= 1"),
    (["debug.nan_steps=[0]"], 1, "debug.nan_steps", ">= 1"),
    (["optim.name=sgd"], 1, "optim.name", "adamw, muon"),
    (["optim.lr=0"], 1, "optim.lr", "> 0"),
    (["optim.schedule=linear"], 1, "optim.schedule", "cosine, wsd, constant"),
    (["optim.implementation=cuda"], 1, "optim.implementation", "fused"),
    (["optim.warmup_steps=1000"], 1, "optim.warmup_steps", "train.steps=60"),
    (["train.steps=5"], 1, "optim.warmup_steps", "Fix: add optim.warmup_steps=1 (at most 5)"),
    (["optim.min_lr_ratio=2"], 1, "optim.min_lr_ratio", "[0, 1]"),
    (["optim.decay_fraction=-0.5"], 1, "optim.decay_fraction", "[0, 1]"),
    (["data.source=web"], 1, "data.source", "stdlib or file"),
    (["data=tokens"], 1, "data.path", "parallel3d-prepare-data"),
    (["data=tokens", "data.path=/nonexistent/corpus.bin"], 1, "data.path", "no such file"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], 1, "data.tokenizer", "tokenizer.json"),
    (["model.vocab_size=200"], 1, "model.vocab_size", "257"),
    (["logging.log_every=0"], 1, "logging.log_every", ">= 1"),
    (["logging.wandb.mode=cloud"], 1, "logging.wandb.mode", "offline"),
    (["logging.straggler_factor=0.5"], 1, "logging.straggler_factor", "0 for off"),
    (["logging.straggler_steps=0"], 1, "logging.straggler_steps", ">= 1"),
    (["profile.steps=[5,3]"], 1, "profile.steps", "within 1..60"),
    (["profile.steps=[3]"], 1, "profile.steps", "profile.steps=[3,4]"),
    (["profile.steps=[3,4]", "profile.ranks=[0,2]"], 2, "profile.ranks", "ranks [2] do not exist"),
    (["profile.memory=true"], 1, "profile.steps", "need steps to profile"),
    (["debug.slow_rank=4"], 4, "debug.slow_rank", "0..3"),
]


@pytest.mark.parametrize("overrides,world_size,key,words", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_refused_with_key_and_fix(overrides, world_size, key, words):
    with pytest.raises(ConfigError) as err:
        check(compose(overrides), world_size)
    message = str(err.value)
    assert err.value.key == key
    assert message.startswith(f"{key}="), message
    assert words in message and "Fix: " in message and "\n" not in message, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusals need a machine without a GPU")
@pytest.mark.parametrize("overrides,key", [
    (["train.device=cuda"], "train.device"),
    (["parallel.cpu_offload=true", "parallel.zero_stage=3"], "parallel.cpu_offload"),
])
def test_refused_on_a_cpu_only_machine(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check(compose(overrides), 2)


@pytest.mark.parametrize("strategy,replicate,stage", [
    ("NO_SHARD", 1, 0), ("SHARD_GRAD_OP", 1, 2), ("FULL_SHARD", 1, 3),
    ("HYBRID_SHARD_ZERO2", 2, 2), ("HYBRID_SHARD", 2, 3),
])
def test_accelerate_strategy_names_set_the_zero_stage(strategy, replicate, stage):
    cfg = compose([f"parallel.fsdp_sharding_strategy={strategy}", f"parallel.dp_replicate={replicate}",
                   "train.micro_batch_size=1"])
    resolved = check(cfg, 8)
    assert resolved.parallel.zero_stage == stage
    assert resolved.parallel.dp_shard == 8 // replicate
    assert (cfg.parallel.zero_stage, cfg.parallel.dp_shard) == (3, -1)  # the given config is left as it was


@pytest.mark.fast
def test_dp_shard_minus_one_takes_the_ranks_left_over():
    cfg = compose(["parallel.dp_replicate=2", "train.micro_batch_size=1"])
    assert check(cfg, 8).parallel.dp_shard == 4
    assert cfg.parallel.dp_shard == -1


@pytest.mark.parametrize("recipe,world_sizes", [("tiny_cpu", (1, 2, 4, 8)), ("llama3_1b", (1, 8)),
                                                ("llama3_8b", (8, 64)), ("llama3_70b", (64, 128)),
                                                ("llama3_405b", (512,)), ("tiny_cpu_3d", (8,))])
def test_recipes_validate_at_their_world_sizes(recipe, world_sizes):
    for world_size in world_sizes:
        check(compose([f"recipe={recipe}", "train.device=cpu"]), world_size)


# --- what a person sees: one line on stderr, a non-zero exit, no traceback ---------------------

def _run(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=180, env=env(),
                          cwd=tmp_path)


def _assert_clean(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


@pytest.mark.fast
def test_train_prints_one_clean_line(tmp_path):
    proc = _run(["-m", "parallel3d.train", "parallel.zero_stage=5"], tmp_path)
    _assert_clean(proc, "parallel.zero_stage=5", "Fix:")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


@pytest.mark.parametrize("override,word", [("train.stepz=3", "train.stepz"), ("train.steps=abc", "train.steps"),
                                           ("recipe=llama3_9b", "llama3_9b")])
def test_unknown_keys_and_wrong_types_are_refused_by_the_schema(override, word, tmp_path, monkeypatch, capsys):
    _assert_clean(_run(["-m", "parallel3d.train", override], tmp_path), word)
    code, stderr = refused_by_the_launcher(["--nproc-per-node=2", override], monkeypatch, capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and word in stderr, stderr


@pytest.mark.fast
def test_launcher_validates_for_the_torchrun_world_size_without_starting_it(monkeypatch, capsys):
    code, stderr = refused_by_the_launcher(["--nproc-per-node=4", "parallel.dp_shard=3"], monkeypatch, capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "parallel.dp_shard=3" in stderr and "world size is 4" in stderr


def test_launcher_checks_every_size_of_an_elastic_node_range(monkeypatch, capsys):
    # 1 node x 2 ranks fits a global batch of 4 with micro batch 2; 2 nodes x 2 ranks do not.
    code, stderr = refused_by_the_launcher(["--nnodes=1:2", "--nproc-per-node=2", "train.global_batch_size=4",
                                            "train.micro_batch_size=2"], monkeypatch, capsys)
    assert code == 2 and "train.global_batch_size=4" in stderr and "world size 4" in stderr, stderr


@pytest.mark.multirank
def test_plain_torchrun_reports_the_error_from_rank_0(tmp_path):
    proc = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "parallel3d.train",
                 "model.n_kv_heads=3"], tmp_path)
    assert proc.returncode != 0
    assert (proc.stderr + proc.stdout).count("model.n_kv_heads=3: grouped-query attention") == 1
