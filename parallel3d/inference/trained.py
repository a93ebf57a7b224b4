"""A trained model as a user names it, opened in one process for generation and lm-eval.

The name may be a checkpoint (a step_<N> folder, a checkpoints/ folder or a run_dir: the newest
complete checkpoint that verifies), a Hugging Face folder (config.json and *.safetensors, read as
``checkpoint.init_from`` reads it), or a run_dir that kept no checkpoint but its export
(``run_dir/hf/``, ``train.save_model=true``).

Where generation ends is a set of token ids, the one transformers' ``generate`` stops at on the
same model: a folder's ``generation_config.json`` ``eos_token_id`` (an id or a list; config.json's
where the folder has no generation_config.json), a run's the ids its export writes there (the
tokenizer's eos and the chat template's end of turn: ``parallel3d.hf.export.end_token_ids``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from parallel3d.base import RunError
from parallel3d.checkpoint.commit import COMPLETE
from parallel3d.checkpoint.resume import pick_checkpoint
from parallel3d.config.hf_folder import is_hf_dir
from parallel3d.data.tokenizer import load_tokenizer, tokenizer_file
from parallel3d.hf.export import end_token_ids
from parallel3d.inference.generate import load_hf_model, load_model, saved_config
from parallel3d.models import Transformer

EXPORT_DIR = "hf"  # train.save_model's folder in a run_dir
NAMES = "a step_<N> folder, a checkpoints/ folder, a run_dir, or a Hugging Face folder (config.json + *.safetensors)"


@dataclass
class Trained:
    """The model, the config it trained with (a folder's: as ``checkpoint.init_from`` composes it),
    what was read (a step_<N> folder or a Hugging Face folder) and whether that is a folder."""

    model: Transformer
    config: Any
    origin: Path
    is_folder: bool

    @property
    def tokenizer_spec(self) -> str | None:
        """The run's data.tokenizer; a folder's own tokenizer (None where it has no tokenizer.json)."""
        if self.is_folder:
            return str(self.origin) if tokenizer_file(self.origin).is_file() else None
        return str(self.config.data.tokenizer)

    def end_ids(self, tokenizer) -> frozenset[int]:
        """The ids generation stops at (``tokenizer``: the opened tokenizer_spec, or None where it
        cannot be read: a folder's generation_config.json still says, a run's eos is then unknown)."""
        if self.is_folder:
            return folder_end_ids(self.origin)
        if tokenizer is None:
            return frozenset()
        return frozenset(end_token_ids(tokenizer_spec=self.tokenizer_spec,
                                       chat_template=self.config.data.get("chat_template")))


def locate(path: Path, *, verify: str = "checksum", announce: bool = False) -> tuple[Path, bool]:
    """(the checkpoint or Hugging Face folder ``path`` names, whether it is a folder). A run_dir
    without a complete checkpoint that verifies is read from its export, ``hf/``, where it has one.
    Raises RunError (one line) when there is neither."""
    path = path.expanduser()
    if is_hf_dir(path):
        return path, True
    if not path.exists():
        raise RunError(f"{path}: no such file or folder. Fix: name {NAMES}")
    if (path / COMPLETE).is_file():
        return pick_checkpoint(path.parent, str(path), announce, verify=verify), False
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = pick_checkpoint(root, "auto", announce, verify=verify)
    if found is not None:
        return found, False
    if is_hf_dir(path / EXPORT_DIR):
        return path / EXPORT_DIR, True
    raise RunError(f"{path}: no complete checkpoint there and no Hugging Face folder ({EXPORT_DIR}/ with config.json "
                   f"and *.safetensors). Fix: name {NAMES}")


def open_trained(path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 verify: str = "checksum", announce: bool = False) -> Trained:
    """The model ``path`` names (see ``locate``), in eval mode on ``device``."""
    origin, is_folder = locate(path, verify=verify, announce=announce)
    if is_folder:
        model, config = load_hf_model(origin, device=device, dtype=dtype)
        return Trained(model, config, origin, True)
    return Trained(load_model(origin, device=device, dtype=dtype), saved_config(origin), origin, False)


def folder_end_ids(folder: Path) -> frozenset[int]:
    """The ids transformers' generate stops at for a Hugging Face folder: generation_config.json's
    eos_token_id where the folder has that file, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            ids = json.loads((folder / name).read_text()).get("eos_token_id")
            return frozenset(ids if isinstance(ids, list) else [] if ids is None else [ids])
    return frozenset()


def open_tokenizer(spec: str | None):
    """``load_tokenizer(spec)``, or None for a folder without one."""
    return None if spec is None else load_tokenizer(spec)
