"""Text from a trained model: load any checkpoint into one process and decode with a KV cache.

``load_model`` builds the model its checkpoint's config.yaml describes and has DCP assemble every
tensor from the shards of whatever layout saved it (no process group: DCP reshards on read).
``generate`` runs the prompt once, then one token at a time over the model's KV cache
(``parallel3d.models.kv_cache``): greedy at temperature 0, else sampled from the temperature-scaled
distribution cut to its top-p nucleus. It stops at any id of the set ``stop_ids`` (kept in the
output, as transformers' generate keeps the EOS) or after ``max_new_tokens``; a sequence's stop
condition is that set alone (parallel3d/inference/trained.py says which ids a model's is).
``generate_batch`` decodes several prompts at once, left-padded, each as it would be alone (on a
CPU too the per-token cost of a forward is mostly overhead that a batch shares); a row that stops
leaves the batch. ``generate_in_batches`` feeds it a list of prompts, similar lengths together.
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


def next_tokens(logits: torch.Tensor, *, temperature: float, top_p: float,
                generators: list[torch.Generator] | None) -> torch.Tensor:
    """Greedy (temperature 0) or, per row, a sample from the temperature-scaled top-p nucleus of
    logits (b, vocab), each row with its own generator: the tokens (b,)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = (logits.float() / temperature).softmax(dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep the most likely tokens up to and including the one that reaches top_p.
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generators)])


def generate(model: Transformer, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, stop_ids: Collection[int] = (), seed: int = 0) -> list[int]:
    """The ids generated after ``prompt_ids`` (the stop id that ended them included)."""
    return generate_batch(model, [prompt_ids], max_new_tokens=max_new_tokens, temperature=temperature,
                          top_p=top_p, stop_ids=stop_ids, seeds=[seed])[0]


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, stop_ids: Collection[int] = (), seeds: list[int] | None = None
                   ) -> list[list[int]]:
    """The ids generated after each prompt, decoded together: the prompts left-padded to the
    longest, each row with its own positions and blind to the padding (models/kv_cache.py), so a
    row's ids are those it gets alone. A row stops at its first id of ``stop_ids`` (kept) or after
    ``max_new_tokens``, and leaves the batch then. ``seeds``: each row's sampling seed (default 0)."""
    stops = frozenset(stop_ids)
    lengths = [len(p) for p in prompts]
    for length in lengths:
        if not length:
            raise ValueError("the prompt is empty: give at least one token")
        if length + max_new_tokens > model.cfg.max_seq_len:
            raise ValueError(f"prompt ({length} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                             f"model's max_seq_len ({model.cfg.max_seq_len}): ask for fewer tokens")
    device, width = model.rope_cos.device, max(lengths)
    generators = ([torch.Generator(device=device).manual_seed(s) for s in (seeds or [0] * len(prompts))]
                  if temperature > 0 else None)
    pad = torch.tensor([width - n for n in lengths], device=device)
    batch = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=device)
    cache = KVCache(max_len=width + max_new_tokens, pad=pad)
    logits = model(batch, kv_cache=cache)[:, -1]
    out: list[list[int]] = [[] for _ in prompts]
    rows = torch.arange(len(prompts))  # the prompts still decoding, in batch order
    for _ in range(max_new_tokens):
        tokens = next_tokens(logits, temperature=temperature, top_p=top_p,
                             generators=None if generators is None else [generators[r] for r in rows])
        new = tokens.tolist()  # the step's one copy to the host
        for row, token in zip(rows.tolist(), new):
            out[row].append(token)
        going = torch.tensor([token not in stops for token in new])
        if not going.all():  # finished rows leave the batch (and the cache)
            if not going.any():
                break
            rows, tokens = rows[going], tokens[going.to(tokens.device)]
            cache.keep(going.nonzero().flatten())
        if len(out[int(rows[0])]) == max_new_tokens:
            break
        logits = model(tokens[:, None], kv_cache=cache)[:, -1]
    return out


def generate_in_batches(model: Transformer, prompts: list[list[int]], *, batch_size: int,
                        **options) -> list[list[int]]:
    """``generate_batch`` over ``prompts`` ``batch_size`` at a time, the prompts of similar length
    together (less padding); the results in the prompts' order. ``options``: generate_batch's,
    with ``seed`` for the first prompt (prompt i samples with seed + i, whatever the batches)."""
    seed = options.pop("seed", 0)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    results: list[list[int]] = [[] for _ in prompts]
    for first in range(0, len(order), batch_size):
        chosen = order[first:first + batch_size]
        for i, ids in zip(chosen, generate_batch(model, [prompts[i] for i in chosen],
                                                  seeds=[seed + i for i in chosen], **options)):
            results[i] = ids
    return results
