"""Check a composed config against the world size before any process group exists.

``resolve(cfg, world_size)`` makes the shorthand values concrete (``dp_shard=-1``, Accelerate
strategy names) and returns a resolved copy; ``check(cfg, world_size)`` resolves, then raises
:class:`ConfigError` for the first problem it finds and returns the resolved config. Neither
changes the config it is given. Each error names the key, the value, why it cannot work and how
to fix it, in one message meant for a person. Allowed names live with the code that reads them
(pipeline schedules in parallel/pipeline.py, checkpointing modes in parallel/activation.py ...).
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import torch

from parallel3d.base import DTYPES, ConfigError, divisors, resolve_device
from parallel3d.checkpoint.checks import check_checkpoint, run_dir_of
from parallel3d.config.fault_tolerance import check_ft
from parallel3d.config.hf_folder import named_in_folder
from parallel3d.data.checks import check_data
from parallel3d.data.tokenizer import load_tokenizer, tokenizer_file
from parallel3d.hf.lora import check_adapter_export
from parallel3d.models.lora import check_lora
from parallel3d.models.mla import check_attention
from parallel3d.optim.adamw import IMPLEMENTATIONS as OPTIM_IMPLEMENTATIONS
from parallel3d.optim.clip import check_grad_noise
from parallel3d.optim.muon import OPTIMIZERS, check_muon_config
from parallel3d.optim.schedule import LR_SCHEDULES
from parallel3d.parallel.activation import AC_MODES
from parallel3d.parallel.expert import check_experts
from parallel3d.parallel.float8 import check_float8
from parallel3d.parallel.pipeline import SCHEDULES as PP_SCHEDULES
from parallel3d.parallel.pipeline import (fits_rounds, fixed_stages_per_rank, layer_split, min_microbatches,
                                          stages_per_rank)
from parallel3d.runtime.guard import check_bad_step_config

# Re-exported: callers written before parallel3d.base import these names from here.

# Hugging Face Accelerate's FSDP strategy names -> (zero stage, needs dp_replicate > 1).
ACCELERATE_STRATEGIES = {
    "NO_SHARD": (0, False),
    "SHARD_GRAD_OP": (2, False),
    "FULL_SHARD": (3, False),
    "HYBRID_SHARD_ZERO2": (2, True),
    "HYBRID_SHARD": (3, True),
}


def resolve(cfg, world_size: int):
    """``cfg`` with its shorthands made concrete: ``parallel.fsdp_sharding_strategy`` sets
    ``zero_stage``, ``dp_shard=-1`` takes the ranks left over. Returns ``cfg`` itself when there
    is nothing to resolve, else a resolved copy; ``cfg`` is never changed. Raises ConfigError for
    shorthands that cannot be resolved."""
    p = cfg.parallel
    stage = _strategy_stage(p)
    dp_shard = _resolve_dp_shard(p, world_size)
    if stage is None and dp_shard == p.dp_shard:
        return cfg
    cfg = copy.deepcopy(cfg)
    if stage is not None:
        cfg.parallel.zero_stage = stage
    cfg.parallel.dp_shard = dp_shard
    return cfg


def check(cfg, world_size: int, device: str | None = None):
    """Raise ConfigError if ``cfg`` cannot run on ``world_size`` ranks; else return it resolved
    (see :func:`resolve`; ``cfg`` itself is not changed).

    ``device`` ("cpu" or "cuda"): what the run's machines have, when they are not this one (a
    Slurm job submitted from a login node); None: this machine's.
    """
    _check_known_keys(cfg)
    cfg = resolve(cfg, world_size)
    _check_degrees(cfg.parallel, world_size)
    with named_in_folder(cfg):  # a Hugging Face folder's model: its config.json is what to fix
        _check_model(cfg.model, cfg.parallel.tp, cfg.parallel.pp)
        check_experts(cfg.model, cfg.parallel)
    check_lora(cfg)
    check_adapter_export(cfg)
    _check_data_parallel(cfg.parallel, cfg.train, device)
    check_float8(cfg.train, cfg.parallel)
    _check_batch(cfg.train, cfg.parallel, cfg.model)
    check_bad_step_config(cfg.train, cfg.debug)
    check_grad_noise(cfg.debug, cfg.checkpoint, world_size)
    _check_pipeline(cfg.parallel, cfg.train, cfg.model)
    _check_context(cfg.parallel, cfg.train, cfg.model)
    _check_optim(cfg.optim, cfg.train.steps)
    _check_data(cfg.data, cfg.model)
    check_data(cfg)  # data sources, weights, eval
    _check_logging(cfg.logging)
    _check_profile(cfg.profile, cfg.debug, cfg.train.steps, world_size)
    check_checkpoint(cfg.checkpoint, cfg.model, run_dir_of(cfg), world_size)
    check_ft(cfg)
    return cfg


def _check_known_keys(cfg) -> None:
    """A key the schema lacks (added with ``+``, which Hydra lets past the struct check) is refused."""
    from omegaconf import OmegaConf

    from parallel3d.config.schema import Config
    from parallel3d.config.strict import closest_key, unknown_keys

    if not OmegaConf.is_config(cfg):  # a Config dataclass (the planner's callers): no key can be unknown
        return
    tree = OmegaConf.to_container(cfg, resolve=False)
    for key in unknown_keys({k: v for k, v in tree.items() if k != "hydra"}, Config):
        near = closest_key(key, Config)
        raise ConfigError(key, OmegaConf.select(cfg, key, throw_on_resolution_failure=False),
                          "not a key of the config schema", f"use {near}" if near else "remove it (see parallel3d/config/schema.py)")


def _strategy_stage(p) -> int | None:
    """The zero stage ``parallel.fsdp_sharding_strategy`` names (None: unset)."""
    name = p.fsdp_sharding_strategy
    if name is None:
        return None
    if name not in ACCELERATE_STRATEGIES:
        raise ConfigError("parallel.fsdp_sharding_strategy", name, "unknown strategy",
                          f"use one of {', '.join(ACCELERATE_STRATEGIES)} (or set parallel.zero_stage)")
    stage, hybrid = ACCELERATE_STRATEGIES[name]
    if hybrid and p.dp_replicate == 1:
        raise ConfigError("parallel.fsdp_sharding_strategy", name,
                          "hybrid sharding replicates across groups but parallel.dp_replicate=1",
                          "set parallel.dp_replicate to the number of replica groups (e.g. nodes)")
    if not hybrid and p.dp_replicate > 1:
        raise ConfigError("parallel.fsdp_sharding_strategy", name,
                          f"parallel.dp_replicate={p.dp_replicate} asks for hybrid sharding",
                          "use HYBRID_SHARD or HYBRID_SHARD_ZERO2, or set parallel.dp_replicate=1")
    return stage


def _resolve_dp_shard(p, world_size: int) -> int:
    """``parallel.dp_shard``, with -1 replaced by the ranks left over after dp_replicate, tp, pp, cp."""
    for key in ("dp_replicate", "tp", "pp", "cp"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallel.{key}", getattr(p, key), "a parallel degree must be >= 1", "use 1 or more")
    if p.dp_shard != -1:
        return p.dp_shard
    rest = p.dp_replicate * p.tp * p.pp * p.cp
    if world_size % rest:
        raise ConfigError("parallel.dp_shard", -1, f"world size {world_size} is not divisible by "
                          f"dp_replicate*tp*pp*cp = {rest}", f"launch a multiple of {rest} ranks or change dp_replicate/tp/pp/cp")
    return world_size // rest


def _check_degrees(p, world_size: int) -> None:
    if p.dp_shard < 1:
        raise ConfigError("parallel.dp_shard", p.dp_shard, "must be >= 1, or -1 for all ranks left over",
                          "use -1 or a positive degree")
    product = p.dp_replicate * p.dp_shard * p.tp * p.pp * p.cp
    if product != world_size:
        # dp_shard=-1 helps only where the other degrees divide the world size (not one process for a 3D recipe)
        fits = world_size % (p.dp_replicate * p.tp * p.pp * p.cp) == 0
        raise ConfigError("parallel.dp_shard", p.dp_shard,
                          f"dp_replicate*dp_shard*tp*pp*cp = {p.dp_replicate}*{p.dp_shard}*{p.tp}*{p.pp}*{p.cp} = "
                          f"{product} but the world size is {world_size}",
                          f"make the product {world_size}, e.g. parallel.dp_shard=-1" if fits else
                          f"start {product} ranks: parallel3d-run --nproc-per-node {product} with the same arguments")


def _check_model(m, tp: int, pp: int) -> None:
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key}", getattr(m, key), "must be positive", "use a positive size")
    if m.activation_checkpoint not in AC_MODES:
        raise ConfigError("model.activation_checkpoint", m.activation_checkpoint, "unknown mode",
                          f"use one of {', '.join(AC_MODES)}")
    if m.activation_checkpoint_every < 1:
        raise ConfigError("model.activation_checkpoint_every", m.activation_checkpoint_every, "must be >= 1",
                          "checkpoint every N >= 1 blocks")
    if m.dim % m.n_heads:
        raise ConfigError("model.dim", m.dim, f"not divisible by model.n_heads={m.n_heads}",
                          f"choose n_heads from {divisors(m.dim)}")
    check_attention(m)
    if m.attention == "gqa" and (m.dim // m.n_heads) % 2:
        raise ConfigError("model.n_heads", m.n_heads, f"head dim {m.dim // m.n_heads} is odd and RoPE rotates pairs",
                          "choose dim and n_heads so that dim/n_heads is even")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError("model.n_kv_heads", m.n_kv_heads, f"grouped-query attention needs it to divide "
                          f"model.n_heads={m.n_heads}", f"choose n_kv_heads from {divisors(m.n_heads)}")
    if m.compile and tp > 1:
        raise ConfigError("model.compile", True, f"compiled blocks under parallel.tp={tp} fail in backward in "
                          f"torch {torch.__version__.split('+')[0]} (DTensor redistribute receives a plain tensor)",
                          "set model.compile=false with tensor parallelism; compile works with dp and pp")
    for key in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "dim"):
        size = getattr(m, key)
        if size % tp:
            ok = [d for d in divisors(size) if d <= 64]
            raise ConfigError("parallel.tp", tp, f"tensor parallelism splits model.{key}={size} across tp ranks "
                              f"and it is not divisible", f"choose parallel.tp from {ok}")


def _check_data_parallel(p, t, device: str | None) -> None:
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero_stage", p.zero_stage, "ZeRO stages are 0 (DDP), 1, 2 and 3 (FSDP)",
                          "use 0, 1, 2 or 3 (or parallel.fsdp_sharding_strategy=FULL_SHARD etc.)")
    if p.zero_stage >= 2 and p.dp_replicate > 1 and p.dp_shard == 1:
        raise ConfigError("parallel.zero_stage", p.zero_stage, "hybrid sharding with parallel.dp_shard=1 "
                          "shards nothing", "use parallel.zero_stage=0 or 1, or give dp_shard a degree > 1")
    if p.fsdp_wrap not in ("block", "size"):
        raise ConfigError("parallel.fsdp_wrap", p.fsdp_wrap, "unknown wrap policy", "use block or size")
    if p.fsdp_prefetch < 0:
        raise ConfigError("parallel.fsdp_prefetch", p.fsdp_prefetch, "must be >= 0", "use 0 (FSDP default) or N")
    if p.fsdp_prefetch and p.fsdp_wrap != "block":
        raise ConfigError("parallel.fsdp_prefetch", p.fsdp_prefetch, "explicit prefetch counts transformer "
                          "blocks, but parallel.fsdp_wrap=size", "use parallel.fsdp_wrap=block or fsdp_prefetch=0")
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(t, key) not in DTYPES:
            raise ConfigError(f"train.{key}", getattr(t, key), "unknown dtype", f"use one of {', '.join(DTYPES)}")
    if t.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("train.device", t.device, "unknown device", "use auto, cpu or cuda")
    if t.device == "cuda" and device == "cpu":
        raise ConfigError("train.device", "cuda", "the job's nodes have no GPUs (slurm.gpus_per_node=0)",
                          "request GPUs with slurm.gpus_per_node, or set train.device=cpu (or auto)")
    if t.device == "cuda" and device is None and not torch.cuda.is_available():
        raise ConfigError("train.device", "cuda", "no CUDA device is visible on this machine",
                          "run on a GPU machine, or set train.device=cpu (or auto)")
    if p.cpu_offload:
        if p.zero_stage == 0:
            raise ConfigError("parallel.cpu_offload", True, "offload moves FSDP shards to the CPU, but "
                              "parallel.zero_stage=0 (DDP) shards nothing", "use zero_stage 1, 2 or 3")
        if resolve_device(t.device, device) == "cpu":
            raise ConfigError("parallel.cpu_offload", True, "FSDP's CPU offload needs an accelerator and this "
                              "run trains on the CPU already", "set parallel.cpu_offload=false, or train on a GPU")


def _check_pipeline(p, t, m) -> None:
    if p.pp_schedule not in PP_SCHEDULES:
        raise ConfigError("parallel.pp_schedule", p.pp_schedule, "unknown pipeline schedule",
                          f"use one of {', '.join(PP_SCHEDULES)}")
    if p.pp_microbatches is not None and p.pp_microbatches < 1:
        raise ConfigError("parallel.pp_microbatches", p.pp_microbatches, "must be >= 1",
                          "use at least parallel.pp microbatches")
    if p.pp == 1:
        return
    name = p.pp_schedule
    if p.pp_stages_per_rank is not None:
        wanted = fixed_stages_per_rank(name)
        if p.pp_stages_per_rank < 1 or (wanted and p.pp_stages_per_rank != wanted):
            raise ConfigError("parallel.pp_stages_per_rank", p.pp_stages_per_rank,
                              f"parallel.pp_schedule={name} runs {wanted or 'one or more'} stage(s) per rank",
                              "leave it unset, or pick a looped schedule (Interleaved1F1B) for other counts")
    stages = p.pp * stages_per_rank(name, p.pp_stages_per_rank)
    if stages > m.n_layers + 2:
        raise ConfigError("parallel.pp", p.pp, f"{stages} pipeline stages for model.n_layers={m.n_layers} blocks "
                          f"plus embedding and output", f"use at most {m.n_layers + 2} stages in all")
    if p.pp_layers_per_stage is not None:
        counts = list(p.pp_layers_per_stage)
        if len(counts) != stages or sum(counts) != m.n_layers or min(counts) < 0:
            raise ConfigError("parallel.pp_layers_per_stage", counts, f"needs {stages} non-negative block counts "
                              f"(pp x stages per rank) summing to model.n_layers={m.n_layers}",
                              "list the blocks of every stage, first to last")
    split = layer_split(m.n_layers, stages, p.pp_layers_per_stage)
    empty = [i for i, blocks in enumerate(split) if not blocks and 0 < i < stages - 1]
    if empty:
        raise ConfigError("parallel.pp", p.pp, f"stage {empty[0]} of {stages} would hold no block",
                          "give every stage between the first and the last at least one block, or use fewer stages")
    dp = p.dp_replicate * p.dp_shard
    micro_batches = t.global_batch_size // dp // t.micro_batch_size
    n = p.pp_microbatches or micro_batches
    if micro_batches % n:
        raise ConfigError("parallel.pp_microbatches", n, f"does not divide the {micro_batches} micro batches of "
                          f"a rank (global batch / dp / micro batch)", f"use a divisor of {micro_batches}")
    needed = min_microbatches(name, p.pp, stages)
    if n < needed:
        raise ConfigError("parallel.pp_microbatches", n, f"parallel.pp_schedule={name} needs at least {needed} "
                          f"microbatches per step", f"raise train.global_batch_size or lower train.micro_batch_size "
                          f"so each rank has {needed} or more")
    if not fits_rounds(name, p.pp, n):
        raise ConfigError("parallel.pp_microbatches", n, f"{name} runs microbatches in rounds of "
                          f"parallel.pp={p.pp}", f"use a multiple of {p.pp}")


def _check_batch(t, p, m) -> None:
    for key in ("steps", "global_batch_size", "micro_batch_size", "seq_len"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}", getattr(t, key), "must be >= 1", "use a positive number")
    dp = p.dp_replicate * p.dp_shard
    if t.global_batch_size % (dp * t.micro_batch_size):
        raise ConfigError("train.global_batch_size", t.global_batch_size,
                          f"not divisible by data-parallel degree {dp} x train.micro_batch_size="
                          f"{t.micro_batch_size} = {dp * t.micro_batch_size}",
                          f"use a multiple of {dp * t.micro_batch_size}, or a smaller micro batch")
    if p.tp > 1 and p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError("train.seq_len", t.seq_len, f"sequence parallelism splits the sequence over "
                          f"parallel.tp={p.tp} ranks and it is not divisible",
                          f"use a multiple of {p.tp}, or parallel.sequence_parallel=false")
    if t.seq_len > m.max_seq_len:
        raise ConfigError("train.seq_len", t.seq_len, f"longer than model.max_seq_len={m.max_seq_len}",
                          f"use train.seq_len <= {m.max_seq_len}")
    if t.grad_clip < 0:
        raise ConfigError("train.grad_clip", t.grad_clip, "must be >= 0", "use 0 to disable clipping")
    if t.dist_timeout_s < 1:
        raise ConfigError("train.dist_timeout_s", t.dist_timeout_s, "must be >= 1", "use seconds, e.g. 300")


def _check_context(p, t, m) -> None:
    """Context parallelism (parallel/context.py): head-tail chunks, and heads to split for all-to-all."""
    from parallel3d.parallel.context import CP_METHODS

    if p.cp_method not in CP_METHODS:
        raise ConfigError("parallel.cp_method", p.cp_method, "unknown method", f"use one of {', '.join(CP_METHODS)}")
    if p.cp == 1:
        return
    if t.seq_len % (2 * p.cp):
        raise ConfigError("train.seq_len", t.seq_len, f"context parallelism cuts each sequence into 2*cp = "
                          f"{2 * p.cp} chunks (head-tail load balancing)", f"use a multiple of {2 * p.cp}")
    if p.tp > 1 and p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError("train.seq_len", t.seq_len, f"each cp rank's {t.seq_len // p.cp} tokens are split again "
                          f"over parallel.tp={p.tp} ranks (sequence parallelism)", f"use a multiple of {p.cp * p.tp}")
    heads = m.n_heads // p.tp
    if p.cp_method == "alltoall" and heads % p.cp:
        raise ConfigError("parallel.cp", p.cp, f"all-to-all splits each tp rank's {heads} attention heads "
                          f"(model.n_heads/parallel.tp) over cp ranks and they are not divisible",
                          f"choose parallel.cp from {divisors(heads)}, or parallel.cp_method=ring")


def _check_optim(o, steps: int) -> None:
    if o.name not in OPTIMIZERS:
        raise ConfigError("optim.name", o.name, "unknown optimizer", f"use one of {', '.join(OPTIMIZERS)}")
    check_muon_config(o.muon)
    if o.lr <= 0:
        raise ConfigError("optim.lr", o.lr, "must be > 0", "use a positive learning rate, e.g. 3e-4")
    if o.schedule not in LR_SCHEDULES:
        raise ConfigError("optim.schedule", o.schedule, "unknown LR schedule", f"use one of {', '.join(LR_SCHEDULES)}")
    if o.implementation not in OPTIM_IMPLEMENTATIONS:
        raise ConfigError("optim.implementation", o.implementation, "unknown implementation",
                          f"use one of {', '.join(OPTIM_IMPLEMENTATIONS)}")
    if not 0 <= o.warmup_steps <= steps:
        raise ConfigError("optim.warmup_steps", o.warmup_steps, f"must lie in 0..train.steps={steps}",
                          f"add optim.warmup_steps={min(steps, max(1, steps // 10))} (at most {steps})")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", o.min_lr_ratio, "must lie in [0, 1]", "use e.g. 0.1")
    if not 0 <= o.decay_fraction <= 1:
        raise ConfigError("optim.decay_fraction", o.decay_fraction, "must lie in [0, 1]", "use e.g. 0.2")


def _check_data(d, m) -> None:
    if d.source not in ("stdlib", "file"):
        raise ConfigError("data.source", d.source, "unknown data source", "use stdlib or file")
    if d.source == "file":
        if not d.path:
            raise ConfigError("data.path", d.path, "data.source=file needs a token file",
                              "prepare one with parallel3d-prepare-data and pass data.path=FILE")
        if not Path(d.path).expanduser().is_file():
            raise ConfigError("data.path", d.path, "no such file", "check the path (relative paths start at the "
                              "directory you launch from)")
    if d.tokenizer != "byte" and not tokenizer_file(d.tokenizer).is_file():
        raise ConfigError("data.tokenizer", d.tokenizer, "neither 'byte' nor a tokenizer.json or a folder holding one",
                          "use data.tokenizer=byte, a Hugging Face tokenizer.json or its folder")
    vocab = load_tokenizer(d.tokenizer).vocab_size
    if vocab > m.vocab_size:
        raise ConfigError("model.vocab_size", m.vocab_size, f"smaller than the tokenizer's vocabulary ({vocab})",
                          f"use model.vocab_size >= {vocab}")


def _check_logging(lg) -> None:
    if lg.log_every < 1:
        raise ConfigError("logging.log_every", lg.log_every, "must be >= 1", "log every N >= 1 steps")
    if lg.wandb.mode not in (None, "online", "offline", "disabled"):
        raise ConfigError("logging.wandb.mode", lg.wandb.mode, "unknown wandb mode",
                          "use online, offline or disabled")
    if lg.straggler_factor and lg.straggler_factor <= 1:
        raise ConfigError("logging.straggler_factor", lg.straggler_factor, "a rank cannot be slower than "
                          "the median by a factor of 1 or less", "use a factor above 1 (2 is the default), or 0 for off")
    if lg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard", True, "the tensorboard package is not installed",
                          "pip install 'parallel3d[tensorboard]', or use logging=console")
    if lg.straggler_steps < 1:
        raise ConfigError("logging.straggler_steps", lg.straggler_steps, "must be >= 1",
                          "name a straggler after N >= 1 logged steps in a row")


def _check_profile(p, debug, steps: int, world_size: int) -> None:
    """profile.* and debug.slow_rank against the run's steps and ranks (ConfigError)."""
    if p.steps and (len(p.steps) != 2 or not 1 <= p.steps[0] <= p.steps[1] <= steps):
        raise ConfigError("profile.steps", list(p.steps), f"not [first, last] steps within 1..{steps}",
                          "give two steps, e.g. profile.steps=[3,4] (skip the first steps: they warm up)")
    outside = [r for r in p.ranks or [] if not 0 <= r < world_size]
    if outside:
        raise ConfigError("profile.ranks", list(p.ranks), f"ranks {outside} do not exist in {world_size} ranks",
                          f"name ranks 0..{world_size - 1}, or leave it unset for all")
    if (p.ranks is not None or p.memory) and not p.steps:
        raise ConfigError("profile.steps", "[]", "profile.ranks and profile.memory need steps to profile",
                          "set profile.steps=[first,last]")
    if p.top_ops < 0:
        raise ConfigError("profile.top_ops", p.top_ops, "must be >= 0", "list N >= 0 operators")
    if debug.slow_rank is not None and not 0 <= debug.slow_rank < world_size:
        raise ConfigError("debug.slow_rank", debug.slow_rank, f"no such rank in {world_size} ranks",
                          f"use a rank 0..{world_size - 1}")
