#!/usr/bin/env python
"""Export a parallel3d checkpoint as a Hugging Face folder (Llama, Qwen3, Qwen3-MoE or Mixtral: see
parallel3d/hf/families.py): a complete folder, as ``train.save_model=true`` writes it (parallel3d/hf/export.py).

    parallel3d-convert-hf export CHECKPOINT OUT_DIR [--dtype bfloat16|float32|float16]
                                                   [--max-shard-size 5GB]

CHECKPOINT is a ``step_<N>`` folder, or a run_dir or its checkpoints/ folder (then its newest
complete checkpoint). OUT_DIR gets ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` when the weights exceed --max-shard-size, the run's tokenizer
files (byte tokens: an equivalent tokenizer.json), generation_config.json and config.json with the
special token ids. Optimizer state is left out. A LoRA run's adapters are merged into the weights
(W + alpha/rank B A); ``--adapter-dir DIR`` also writes them in PEFT's format (parallel3d/hf/lora.py).
transformers loads the folder as it is:

    AutoModelForCausalLM.from_pretrained(OUT_DIR); AutoTokenizer.from_pretrained(OUT_DIR)

Streaming: tensors are grouped into output files by the sizes in the checkpoint's safetensors
headers, and each output file is read (from every rank's shards, by DCP), written and freed before
the next: peak memory is about one output file, whatever the size of the model.

The other direction needs no tool: ``python -m parallel3d.train checkpoint.init_from=HF_DIR ...``
reads Hugging Face weights directly, each rank only its own slices, at any layout.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import HuggingFaceStorageReader

from parallel3d.base import DTYPES, parse_size
from parallel3d.checkpoint.commit import find_checkpoint
from parallel3d.checkpoint.verify import checkpoint_problem
from parallel3d.config.schema import ModelConfig
from parallel3d.data.tokenizer import tokenizer_file
from parallel3d.hf import families
from parallel3d.hf.export import INDEX, plan_files, refuse_used, write_hf_folder  # noqa: F401  (INDEX, plan_files: the tool's API)
from parallel3d.hf.lora import adapted, merge_adapters, write_adapter
from parallel3d.models import Transformer
from parallel3d.models.lora import is_adapter

# dcp.load without a process group says so on every call; here that is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def shard_size(text: str) -> int:
    """``--max-shard-size``: ``5GB`` -> 5_000_000_000 (as transformers counts), ``500MiB``, ``2e6``, or bytes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        if families.exported_buffers(cfg):  # the sigmoid router's balancing bias, after the parameters
            names += [name for name, _ in model.named_buffers() if name.endswith("expert_bias")]
    missing = [name for name in names if name not in stored]
    if missing:
        raise ValueError(f"{step_dir} lacks {len(missing)} parameters of its own model config, e.g. {missing[0]}")
    return {name: stored[name].size for name in names}


def stored_adapters(step_dir: Path) -> dict[str, torch.Size]:
    """The LoRA adapters a checkpoint holds, with their full shapes (none without LoRA)."""
    stored = HuggingFaceStorageReader(str(step_dir)).read_metadata().state_dict_metadata
    return {name: meta.size for name, meta in stored.items() if is_adapter(name)}


def adapter_shapes(adapters: dict[str, torch.Size], weights: list[str]) -> dict[str, torch.Size]:
    """The adapters of these weights, with their shapes."""
    return {name: adapters[name] for pair in adapted(weights, adapters).values() for name in pair}


def cfg_base_model(step_dir: Path) -> str | None:
    """The Hugging Face folder the run started from (PEFT's base_model_name_or_path), if it did."""
    init_from = OmegaConf.load(step_dir / "config.yaml").checkpoint.init_from
    return str(Path(init_from).expanduser().resolve()) if init_from else None


def merged_loader(step_dir: Path, cfg: ModelConfig, dtype: torch.dtype, adapters: dict[str, torch.Size]):
    """``load(shapes)`` for write_hf_folder: the weights, with a LoRA run's W + alpha/rank B A formed in float32."""
    def load(shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
        if not adapters:
            return load_tensors(step_dir, shapes, dtype)
        weights = load_tensors(step_dir, shapes, torch.float32)
        return merge_adapters(weights, load_tensors(step_dir, adapter_shapes(adapters, list(shapes)), torch.float32),
                              cfg.lora, dtype)
    return load


def load_tensors(step_dir: Path, shapes: dict[str, torch.Size], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """These parameters in full, assembled by DCP from every rank's shards and cast to dtype on read."""
    tensors = {name: torch.empty(shape, dtype=dtype) for name, shape in shapes.items()}
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(step_dir)), no_dist=True)
    return tensors


def export(checkpoint: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16,
           max_shard_bytes: int = 5 * 10**9, adapter_dir: Path | None = None) -> Path:
    """Write the Hugging Face folder (a LoRA run's adapters merged into it, and with ``adapter_dir``
    also written there in PEFT's format); returns the checkpoint it exported."""
    step_dir = find_checkpoint(checkpoint)
    if step_dir is None:
        raise FileNotFoundError(f"{checkpoint}: no complete checkpoint (a step_<N> folder with COMPLETE) there")
    problem = checkpoint_problem(step_dir, "checksum")  # exported only when it verifies, as a resume is
    if problem:
        raise ValueError(f"{step_dir} does not verify: {problem}. Fix: export an earlier checkpoint")
    refuse_used(out_dir)
    cfg = model_config(step_dir)
    adapters = stored_adapters(step_dir)
    if adapter_dir is not None and not adapters:
        raise ValueError(f"{step_dir} has no LoRA adapters (model.lora.rank=0): leave out --adapter-dir")
    if adapter_dir is not None:
        write_adapter(adapter_dir, load_tensors(step_dir, adapters, torch.float32), cfg, cfg_base_model(step_dir))
    write_hf_folder(out_dir, cfg=cfg, shapes=parameter_shapes(step_dir, cfg), dtype=dtype, tokenizer=_tokenizer(step_dir),
                    chat_template=_chat_template(step_dir),
                    load=merged_loader(step_dir, cfg, dtype, adapters), max_shard_bytes=max_shard_bytes,
                    say=lambda line: print(line, flush=True))
    return step_dir


def _chat_template(step_dir: Path) -> str | None:
    """The checkpoint's data.chat_template file, if it set one and this machine has it."""
    template = OmegaConf.load(step_dir / "config.yaml").data.get("chat_template")
    if template and not Path(template).expanduser().is_file():
        print(f"note: chat template {template} not found here; the folder keeps its tokenizer's", file=sys.stderr)
        return None
    return template or None


def _tokenizer(step_dir: Path) -> str | None:
    """The checkpoint's data.tokenizer, if this machine has it."""
    spec = OmegaConf.load(step_dir / "config.yaml").data.tokenizer
    if spec == "byte" or tokenizer_file(spec).is_file():
        return spec
    print(f"note: tokenizer {spec} not found here; the folder has no tokenizer files and no token ids",
          file=sys.stderr)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("export", help="a checkpoint -> a Hugging Face folder")
    p.add_argument("checkpoint", type=Path, help="a step_<N> folder, a checkpoints/ folder or a run_dir")
    p.add_argument("out_dir", type=Path, help="folder to write (new, or without safetensors files)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the written weights")
    p.add_argument("--max-shard-size", type=shard_size, default="5GB",
                   help="largest output file, e.g. 5GB (default), 500MB, 2GiB")
    p.add_argument("--adapter-dir", type=Path, default=None,
                   help="a LoRA run: also write its adapters there in PEFT's format (OUT_DIR gets them merged)")
    args = parser.parse_args(argv)
    try:
        step_dir = export(args.checkpoint, args.out_dir, DTYPES[args.dtype], args.max_shard_size, args.adapter_dir)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        return 1
    print(f"exported {step_dir} -> {args.out_dir} ({args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
