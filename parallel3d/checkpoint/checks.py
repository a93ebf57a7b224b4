"""The checkpoint section of validation: checkpoint.* keys, and what a resume or ``init_from``
would load against the model this run builds (one ConfigError line before any process group)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from parallel3d.base import GIB, ConfigError
from parallel3d.checkpoint.commit import complete_steps, find_checkpoint
from parallel3d.checkpoint.manifest import VERIFY_MODES, ManifestMissing, file_problem
from parallel3d.config import hf_folder
from parallel3d.config.schema import ModelConfig
from parallel3d.models.size import parameter_count, with_value

# The model shape a checkpoint must share with the run that loads it (the layout may differ).
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")


def run_dir_of(cfg) -> Path | None:
    """The run's directory, where a config knows it (outside a Hydra run, from run_dir)."""
    try:
        return Path(str(cfg.run_dir)).expanduser()
    except (OmegaConfBaseException, ValueError):  # Hydra's own run dir is known only inside a Hydra run
        return None


def check_checkpoint(ck, m, run_dir: Path | None, world_size: int = 1) -> None:
    """checkpoint.* against the run: modes, a resume or init_from of the same model's shape, and a
    Hugging Face folder's model small enough for the ``world_size`` ranks' memory."""
    for key in ("every", "keep_last"):
        if getattr(ck, key) < 0:
            raise ConfigError(f"checkpoint.{key}", getattr(ck, key), "must be >= 0", "use 0 (off / keep all) or N")
    if ck.verify not in VERIFY_MODES:
        raise ConfigError("checkpoint.verify", ck.verify, "unknown mode", f"use one of {', '.join(VERIFY_MODES)}")
    if ck.resume == "auto" and run_dir is not None:
        root = run_dir / "checkpoints"
        for step in reversed(complete_steps(root)):  # the newest whose config verifies, as the resume falls back
            if _check_saved_shape("checkpoint.resume", ck.resume, root / f"step_{step}", m, ck.verify):
                break
    if ck.resume not in ("auto", "none"):
        found = find_checkpoint(Path(ck.resume).expanduser())
        if found is None:
            raise ConfigError("checkpoint.resume", ck.resume, "no complete checkpoint there", "give a step_<N> "
                              "folder, a checkpoints/ folder or a run_dir holding one, or use auto or none")
        _check_saved_shape("checkpoint.resume", ck.resume, found, m, ck.verify)
    if ck.init_from:
        path = Path(ck.init_from).expanduser()
        if hf_folder.is_hf_dir(path):
            hf_folder.check_agrees(path, m)
            check_hf_size(path, m, world_size)
        elif (found := find_checkpoint(path)) is None:
            raise ConfigError("checkpoint.init_from", ck.init_from, "neither a checkpoint nor a Hugging Face "
                              "folder (config.json + *.safetensors)", "check the path")
        else:
            _check_saved_shape("checkpoint.init_from", ck.init_from, found, m, ck.verify)


def saved_model(checkpoint: Path, verify: str) -> dict | None:
    """The model section of ``checkpoint``'s config.yaml, read only once that file verifies against
    the checkpoint's manifest (as ``verify`` says); None when it cannot be trusted or read. The
    resume then verifies the whole checkpoint and falls back (or refuses), naming the damage."""
    try:
        if file_problem(checkpoint, "config.yaml", verify) is not None:
            return None
    except ManifestMissing:
        pass  # saved before manifests: the structural checks of the resume judge it
    try:
        model = (yaml.safe_load((checkpoint / "config.yaml").read_text()) or {}).get("model")
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return None
    return model if isinstance(model, dict) and all(k in model for k in SHAPE_KEYS) else None


def _check_saved_shape(key: str, value: str, checkpoint: Path, m, verify: str) -> bool:
    """Refuse a checkpoint of another model shape; False when its config cannot be trusted."""
    saved = saved_model(checkpoint, verify)
    if saved is None:
        return False
    for name in SHAPE_KEYS:
        if saved[name] != m[name]:
            raise ConfigError(key, value, f"{checkpoint.name} holds a model with model.{name}={saved[name]}, this "
                              f"run builds model.{name}={m[name]}", f"set model.{name}={saved[name]} (the layout "
                              f"may change freely, the model's shape may not)")
    return True


def check_hf_size(path: Path, m, world_size: int) -> None:
    """Every number of a Hugging Face config that sizes the model, checked before anything is
    built: the parameter count (models/size.py, from the config alone) times the least model state
    a parameter needs (fp32 weights, gradients and AdamW's two moments: 16 bytes; a frozen LoRA
    base: its weights, 4), sharded over every rank, must fit one rank's memory."""
    cfg = OmegaConf.to_object(m) if OmegaConf.is_config(m) else m
    try:
        count = parameter_count(cfg)
    except (RuntimeError, ValueError, OverflowError):  # a shape too large for torch to describe
        count = None
    per_parameter = 4 if cfg.lora.rank else 16
    memory = _rank_memory_bytes(world_size)
    if count is not None and count * per_parameter / world_size <= memory:
        return
    key = _largest_factor(cfg, path)
    hf_key, value = hf_folder.read_model(path)[key]
    size = (f"a model of {count:.3g} parameters, at least {count * per_parameter / world_size / GIB:,.0f} GiB "
            f"of model state a rank ({per_parameter} bytes a parameter over {world_size} ranks)"
            if count is not None else "a model too large for torch to describe")
    raise ConfigError("checkpoint.init_from", path, f"its config.json has {hf_key}={value}: {size}, more than the "
                      f"{memory / GIB:,.0f} GiB a rank has", f"check {hf_key} in {path / 'config.json'} (damaged "
                      f"or mistyped?), or run on more ranks or larger devices")


def _largest_factor(cfg: ModelConfig, path: Path) -> str:
    """The model key of the folder's config whose value makes the model largest: the one that,
    set to 1, shrinks the parameter count most (a damaged or mistyped field stands out so)."""
    counts = {}
    for key, (_, value) in hf_folder.read_model(path).items():
        if type(value) is int and value > 1:
            try:
                counts[key] = parameter_count(with_value(cfg, key, 1))
            except (RuntimeError, ValueError, OverflowError, ZeroDivisionError):
                continue
    return min(counts, key=counts.get) if counts else "n_layers"


def _rank_memory_bytes(world_size: int) -> int:
    """One rank's memory: its GPU's, or on CPU the host's shared by the ranks on it."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world_size
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local, 1)
