#!/usr/bin/env python
"""Export a parallel3d checkpoint as a Hugging Face folder (Llama, Qwen3, Qwen3-MoE or Mixtral: see
parallel3d/hf.py): safetensors files + config.json.

    parallel3d-convert-hf export CHECKPOINT OUT_DIR [--dtype bfloat16|float32|float16]
                                                   [--max-shard-size 5GB]

CHECKPOINT is a ``step_<N>`` folder, or a run_dir or its checkpoints/ folder (then its newest
complete checkpoint). OUT_DIR gets ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` when the weights exceed --max-shard-size, then
``config.json``, and ``tokenizer.json`` when the run trained with one. Optimizer state is left out.
transformers loads the folder as it is:

    LlamaForCausalLM.from_pretrained(OUT_DIR)

Streaming: tensors are grouped into output files by the sizes in the checkpoint's safetensors
headers, and each output file is read (from every rank's shards, by DCP), written and freed before
the next: peak memory is about one output file, whatever the size of the model.

The other direction needs no tool: ``python -m parallel3d.train checkpoint.init_from=HF_DIR ...``
reads Hugging Face weights directly, each rank only its own slices, at any layout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors.torch import save_file
from torch.distributed.checkpoint import HuggingFaceStorageReader

from parallel3d import hf
from parallel3d.checkpoint import find_checkpoint
from parallel3d.resume import checkpoint_problem
from parallel3d.config import ModelConfig
from parallel3d.models import Transformer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
INDEX = "model.safetensors.index.json"
_UMASK = os.umask(0)
os.umask(_UMASK)

# dcp.load without a process group says so on every call; here that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def parse_size(text: str) -> int:
    """``5GB`` -> 5_000_000_000 (as transformers counts), ``500MiB``, ``2e6``, or plain bytes."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (say 5GB, 500MB, 2GiB or a number of bytes)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def model_config(step_dir: Path) -> ModelConfig:
    """The model config the checkpoint was trained with, checked against the schema."""
    saved = OmegaConf.load(step_dir / "config.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), saved.model))


def parameter_shapes(step_dir: Path, cfg: ModelConfig) -> dict[str, torch.Size]:
    """Full shapes of the model's parameters, in the model's order, from the safetensors headers.

    The order (embedding, blocks, norm, output) is the model's, so each output file holds
    neighbouring layers, as published Hugging Face checkpoints do.
    """
    stored = HuggingFaceStorageReader(str(step_dir)).read_metadata().state_dict_metadata
    with torch.device("meta"):
        model = Transformer(cfg)
        names = [name for name, _ in model.named_parameters()]
        if hf.exported_buffers(cfg):  # the sigmoid router's balancing bias, after the parameters
            names += [name for name, _ in model.named_buffers() if name.endswith("expert_bias")]
    missing = [name for name in names if name not in stored]
    if missing:
        raise ValueError(f"{step_dir} lacks {len(missing)} parameters of its own model config, e.g. {missing[0]}")
    return {name: stored[name].size for name in names}


def renamed_keys(names: list[str], shapes: dict[str, torch.Size], cfg: ModelConfig) -> list[str]:
    """The Hugging Face keys of these parameters (stacked experts: one per expert)."""
    return [key for name in names for key in hf.hf_tensors(name, torch.empty(shapes[name], device="meta"), cfg)]


def plan_files(shapes: dict[str, torch.Size], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Consecutive parameters per output file, each file at most max_bytes (a larger tensor alone)."""
    files, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * dtype.itemsize
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    return files


def load_tensors(step_dir: Path, shapes: dict[str, torch.Size], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """These parameters in full, assembled by DCP from every rank's shards and cast to dtype on read."""
    tensors = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(step_dir)), no_dist=True)
    return tensors


def _replace_atomic(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader sees the whole file or none


def write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    _replace_atomic(tmp, path)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    # The .tmp suffix keeps a partial file out of every *.safetensors glob (DCP's reader's too).
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})  # transformers checks the format
    os.chmod(tmp, 0o666 & ~_UMASK)  # safetensors creates 0600 files; a model folder is for sharing
    _replace_atomic(tmp, path)


def export(checkpoint: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
           max_shard_bytes: int = 5 * 10**9) -> Path:
    """Write the Hugging Face folder; returns the checkpoint it exported."""
    step_dir = find_checkpoint(checkpoint)
    if step_dir is None:
        raise FileNotFoundError(f"{checkpoint}: no complete checkpoint (a step_<N> folder with COMPLETE) there")
    problem = checkpoint_problem(step_dir, "checksum")  # exported only when it verifies, as a resume is
    if problem:
        raise ValueError(f"{step_dir} does not verify: {problem}. Fix: export an earlier checkpoint")
    if out_dir.is_dir() and any(out_dir.glob("*.safetensors")):
        # Loaders read every *.safetensors in a folder: stale files would mix into this model.
        raise FileExistsError(f"{out_dir} holds safetensors files already: export into a new folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model_config(step_dir)
    hf.check_exportable(cfg)
    shapes = parameter_shapes(step_dir, cfg)
    files = plan_files(shapes, dtype, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(files, start=1):
        filename = "model.safetensors" if len(files) == 1 else f"model-{i:05d}-of-{len(files):05d}.safetensors"
        tensors = load_tensors(step_dir, {name: shapes[name] for name in names}, dtype)
        # Renamed; stacked experts as one tensor per expert (copies of one row each, for the file).
        renamed = {key: t.contiguous() for name, full in tensors.items()
                   for key, t in hf.hf_tensors(name, full, cfg).items()}
        write_safetensors(out_dir / filename, renamed)
        del tensors, renamed  # before the next file is read: one file's tensors in memory at a time
        weight_map.update({key: filename for key in renamed_keys(names, shapes, cfg)})
        print(f"{out_dir / filename}: {len(names)} tensors", flush=True)
    if len(files) > 1:
        total = sum(shape.numel() * dtype.itemsize for shape in shapes.values())
        write_json(out_dir / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _copy_tokenizer(step_dir, out_dir)
    # Last: a folder counts as a Hugging Face model (hf.is_hf_dir) only once its weights are all there.
    write_json(out_dir / "config.json", hf.hf_config(cfg, dtype))
    return step_dir


def _copy_tokenizer(step_dir: Path, out_dir: Path) -> None:
    spec = OmegaConf.load(step_dir / "config.yaml").data.tokenizer
    path = Path(spec).expanduser()
    if spec != "byte" and path.is_file():  # byte tokens have no Hugging Face tokenizer file
        shutil.copyfile(path, out_dir / "tokenizer.json")
    elif spec != "byte":
        print(f"note: tokenizer {spec} not found here; copy its tokenizer.json into {out_dir} yourself",
              file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("export", help="a checkpoint -> a Hugging Face Llama folder")
    p.add_argument("checkpoint", type=Path, help="a step_<N> folder, a checkpoints/ folder or a run_dir")
    p.add_argument("out_dir", type=Path, help="folder to write (new, or without safetensors files)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the written weights")
    p.add_argument("--max-shard-size", type=parse_size, default="5GB",
                   help="largest output file, e.g. 5GB (default), 500MB, 2GiB")
    args = parser.parse_args(argv)
    try:
        step_dir = export(args.checkpoint, args.out_dir, DTYPES[args.dtype], args.max_shard_size)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        return 1
    print(f"exported {step_dir} -> {args.out_dir} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
