"""The checkpoint section of validation: checkpoint.* keys, and what a resume or ``init_from``
would load against the model this run builds (one ConfigError line before any process group)."""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf.errors import OmegaConfBaseException

from parallel3d.base import ConfigError
from parallel3d.checkpoint.commit import complete_steps, find_checkpoint
from parallel3d.checkpoint.manifest import VERIFY_MODES, ManifestMissing, file_problem
from parallel3d.config import hf_folder

# The model shape a checkpoint must share with the run that loads it (the layout may differ).
SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings")


def run_dir_of(cfg) -> Path | None:
    """The run's directory, where a config knows it (outside a Hydra run, from run_dir)."""
    try:
        return Path(str(cfg.run_dir)).expanduser()
    except (OmegaConfBaseException, ValueError):  # Hydra's own run dir is known only inside a Hydra run
        return None


def check_checkpoint(ck, m, run_dir: Path | None) -> None:
    """checkpoint.* against the run: modes, and a resume or init_from of the same model's shape."""
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
