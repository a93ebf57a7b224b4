"""Text from a trained model: load any checkpoint into one process and decode with a KV cache.

``load_model`` builds the model its checkpoint's config.yaml describes and has DCP assemble every
tensor from the shards of whatever layout saved it (no process group: DCP reshards on read).
``generate`` runs the prompt once, then one token at a time over the model's KV cache
(``parallel3d.models.kv_cache``): greedy at temperature 0, else sampled from the temperature-scaled
distribution cut to its top-p nucleus. It stops at any id of the set ``stop_ids`` (kept in the
output, as transformers' generate keeps the EOS) or after ``max_new_tokens``; a sequence's stop
condition is that set alone (parallel3d/inference/trained.py says which ids a model's is).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from pathlib import Path

import torch
from omegaconf import OmegaConf

from parallel3d.base import RunError
from parallel3d.checkpoint.checkpointer import Checkpointer
from parallel3d.checkpoint.commit import COMPLETE
from parallel3d.checkpoint.resume import pick_checkpoint
from parallel3d.checkpoint.state import TrainState
from parallel3d.config.schema import CheckpointConfig, ModelConfig
from parallel3d.models import Transformer
from parallel3d.models.kv_cache import KVCache
from parallel3d.models.lora import apply_lora

# dcp.load without a process group says so on every call; here that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def resolve_checkpoint(path: Path, *, verify: str = "checksum", announce: bool = False) -> Path:
    """The checkpoint ``path`` names, verified: a step_<N> folder itself, else the newest complete
    one of a run_dir or checkpoints/ folder that verifies. Raises RunError (one line) otherwise."""
    path = path.expanduser()
    if (path / COMPLETE).is_file():
        return pick_checkpoint(path.parent, str(path), announce, verify=verify)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = pick_checkpoint(root, "auto", announce, verify=verify)
    if found is None:
        raise RunError(f"{path}: no complete checkpoint there. Fix: name a step_<N> folder, a checkpoints/ "
                       f"folder or a run_dir")
    return found


def saved_config(step_dir: Path):
    """The resolved config the checkpoint's run trained with (its config.yaml)."""
    return OmegaConf.load(step_dir / "config.yaml")


def load_model(step_dir: Path, *, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> Transformer:
    """The whole model of checkpoint ``step_dir`` in this process, in eval mode."""
    cfg: ModelConfig = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), saved_config(step_dir).model))
    with torch.device("meta"):
        model = Transformer(cfg)
        if cfg.lora.rank:  # a LoRA run's adapters, loaded with the rest: without them it is the base model
            apply_lora(model, cfg.lora)
    model.to_empty(device=device)
    model.to(dtype)
    model.init_rope()  # float32 tables, as training computes them
    # Weights and trained buffers (the sigmoid router's bias) from every rank's shards, cast on read.
    Checkpointer(step_dir.parent.parent, CheckpointConfig()).load(step_dir, TrainState([model]))
    return model.eval()


def load_hf_model(folder: Path, *, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> tuple[Transformer, object]:
    """A Hugging Face folder's model in this process, as ``checkpoint.init_from`` reads it (the
    folder's config.json alone defines it), in eval mode; and the composed run config."""
    from parallel3d.config.compose import compose

    composed = compose([f"checkpoint.init_from={folder}"])
    cfg: ModelConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), composed.model))
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    model.init_weights(0)  # RoPE tables and every buffer; the folder's weights replace the rest
    Checkpointer(folder, CheckpointConfig()).load_weights(folder, TrainState([model]), cfg)
    model.to(dtype)
    model.init_rope()  # float32 tables, as training computes them
    return model.eval(), composed


def next_token(logits: torch.Tensor, *, temperature: float, top_p: float,
               generator: torch.Generator | None) -> int:
    """Greedy (temperature 0) or a sample from the temperature-scaled top-p nucleus of logits (vocab,)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = (logits.float() / temperature).softmax(dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the most likely tokens up to and including the one that reaches top_p.
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, stop_ids: Collection[int] = (), seed: int = 0) -> list[int]:
    """The ids generated after ``prompt_ids`` (the stop id that ended them included)."""
    stop_ids = frozenset(stop_ids)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    total = len(prompt_ids) + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                         f"model's max_seq_len ({model.cfg.max_seq_len}): ask for fewer tokens")
    device = model.rope_cos.device
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    cache = KVCache(max_len=total)
    logits = model(torch.tensor([prompt_ids], device=device), kv_cache=cache)[0, -1]
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = next_token(logits, temperature=temperature, top_p=top_p, generator=generator)
        out.append(token)
        if token in stop_ids:
            break
        logits = model(torch.tensor([[token]], device=device), kv_cache=cache)[0, -1]
    return out
