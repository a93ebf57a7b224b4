"""A complete Hugging Face folder out: what ``parallel3d-convert-hf export`` and
``train.save_model=true`` (``run_dir/hf/``) both write, by the same code.

    config.json                 the family's config (families.hf_config) with bos/eos/pad token ids
    generation_config.json      bos, eos (a list when the chat template ends a turn with another token), pad
    model.safetensors           or model-0000i-of-0000n.safetensors + model.safetensors.index.json when large
    tokenizer.json ...          the run's tokenizer folder: tokenizer.json, tokenizer_config.json,
                                special_tokens_map.json, chat_template.jinja (those it has)

A run with a bare tokenizer.json gets a tokenizer_config.json naming its special tokens, so
AutoTokenizer loads it as PreTrainedTokenizerFast; a byte-tokenizer run gets a tokenizer.json that
tokenizes exactly as ByteTokenizer does (``byte_tokenizer_json``). config.json is written last: a
folder counts as a Hugging Face model (hf_folder.is_hf_dir) only once its weights are all there.

``save_state_dict`` writes a folder from a full state dict with our names (a merged LoRA model, say).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from parallel3d.config.schema import ModelConfig
from parallel3d.data.chat import load_chat_template
from parallel3d.data.tokenizer import ID_FILES, TOKENIZER_FILE, ByteTokenizer, load_tokenizer
from parallel3d.hf import families

INDEX = "model.safetensors.index.json"
BYTE_EOS = "<|endoftext|>"
# Tokens that end a chat turn in the templates of the families here (Qwen's ChatML, Llama 3, Phi, Gemma).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_UMASK = os.umask(0)
os.umask(_UMASK)


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


def refuse_used(out_dir: Path) -> None:
    if out_dir.is_dir() and any(out_dir.glob("*.safetensors")):
        # Loaders read every *.safetensors in a folder: stale files would mix into this model.
        raise FileExistsError(f"{out_dir} holds safetensors files already: export into a new folder")


def write_hf_folder(out_dir: Path, *, cfg: ModelConfig, shapes: dict[str, torch.Size], dtype: torch.dtype,
                    load: Callable[[dict[str, torch.Size]], dict[str, torch.Tensor]], tokenizer: str | None,
                    chat_template: str | None = None, max_shard_bytes: int = 5 * 10**9,
                    say: Callable[[str], None] = lambda line: None) -> None:
    """The whole folder. ``shapes``: our parameter names in the model's order and their full
    shapes; ``load(shapes)``: those parameters in full, in ``dtype`` (called once per output file,
    so at most one file's tensors are in memory); ``tokenizer``: the run's data.tokenizer (None:
    not available here; then no tokenizer files and no token ids); ``chat_template``: the run's
    data.chat_template file, which replaces the tokenizer folder's template."""
    families.check_exportable(cfg)
    refuse_used(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = plan_files(shapes, dtype, max_shard_bytes)
    weight_map = {}
    for i, names in enumerate(files, start=1):
        filename = "model.safetensors" if len(files) == 1 else f"model-{i:05d}-of-{len(files):05d}.safetensors"
        tensors = load({name: shapes[name] for name in names})
        # Renamed; stacked experts as one tensor per expert (copies of one row each, for the file).
        renamed = {key: t.contiguous().clone() if t.dim() and ".experts." in key else t.contiguous()
                   for name, full in tensors.items() for key, t in families.hf_tensors(name, full, cfg).items()}
        write_safetensors(out_dir / filename, renamed)
        weight_map.update({key: filename for key in renamed})
        del tensors, renamed  # before the next file is read: one file's tensors in memory at a time
        say(f"{out_dir / filename}: {len(names)} tensors")
    if len(files) > 1:
        total = sum(shape.numel() * dtype.itemsize for shape in shapes.values())
        write_json(out_dir / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    ids = {}
    if tokenizer is not None:
        write_tokenizer(out_dir, tokenizer, model_max_length=cfg.max_seq_len, chat_template=chat_template)
        ids = token_ids(out_dir)
        write_json(out_dir / "generation_config.json", generation_config(out_dir, ids))
    write_json(out_dir / "config.json", families.hf_config(cfg, dtype) | {f"{k}_token_id": v for k, v in ids.items()})


def save_state_dict(out_dir: Path, state: dict[str, torch.Tensor], *, cfg: ModelConfig, tokenizer: str | None,
                    chat_template: str | None = None, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 5 * 10**9) -> None:
    """A folder from a full state dict with our parameter names (as ``Transformer.state_dict()``
    holds them; in its dtype unless ``dtype`` is given)."""
    dtype = dtype or next(iter(state.values())).dtype
    from parallel3d.models import Transformer

    with torch.device("meta"):  # the model's order: each file holds neighbouring layers
        model = Transformer(cfg)
        names = [name for name, _ in model.named_parameters()]
        if families.exported_buffers(cfg):  # the sigmoid router's balancing bias (DeepSeek-V3's folders keep it)
            names += [name for name, _ in model.named_buffers() if name.endswith("expert_bias")]
    shapes = {name: state[name].shape for name in names}
    write_hf_folder(out_dir, cfg=cfg, shapes=shapes, dtype=dtype, tokenizer=tokenizer, chat_template=chat_template,
                    load=lambda part: {name: state[name].to(dtype) for name in part}, max_shard_bytes=max_shard_bytes)


def save_run_model(run_dir: Path, state: dict[str, torch.Tensor], *, model_cfg: ModelConfig, tokenizer: str,
                   chat_template: str | None = None) -> str:
    """train.save_model: ``run_dir/hf/``, in the weights' own dtype. A model no Hugging Face family
    here has (shared experts, the sigmoid router) keeps our names in ``run_dir/model.safetensors``
    instead. Returns the console line saying which."""
    try:
        families.check_exportable(model_cfg)
    except ValueError as e:
        save_file({k: v.contiguous() for k, v in state.items()}, str(run_dir / "model.safetensors"))
        return f"parallel3d: wrote {run_dir / 'model.safetensors'} (parallel3d names), not a Hugging Face folder: {e}"
    shutil.rmtree(run_dir / "hf", ignore_errors=True)  # this run's own earlier end (a resumed run ends again)
    save_state_dict(run_dir / "hf", state, cfg=model_cfg, tokenizer=tokenizer, chat_template=chat_template)
    return f"parallel3d: Hugging Face folder written to {run_dir / 'hf'}"


# -- the tokenizer ----------------------------------------------------------------------------------


def write_tokenizer(out_dir: Path, spec: str, *, model_max_length: int, chat_template: str | None = None) -> None:
    """The run's tokenizer files; for a bare tokenizer.json (or byte tokens) a tokenizer_config.json
    too; ``chat_template`` (data.chat_template, a file) as the folder's template."""
    path = Path(spec).expanduser()
    if spec == "byte":
        write_json(out_dir / TOKENIZER_FILE, byte_tokenizer_json())
    elif path.is_dir():
        for name in ID_FILES:
            if (path / name).is_file():
                shutil.copyfile(path / name, out_dir / name)
    else:
        shutil.copyfile(path, out_dir / TOKENIZER_FILE)
        found = load_chat_template(tokenizer_spec=spec)  # the one instruction data rendered with: the file's folder's
        if found is not None:
            (out_dir / "chat_template.jinja").write_text(found.source)
    if not (out_dir / "tokenizer_config.json").is_file():
        tok = load_tokenizer(spec)
        name = (lambda i: None if i is None else BYTE_EOS if spec == "byte" else tok.token(i))
        write_json(out_dir / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name(tok.bos_id), "eos_token": name(tok.eos_id),
            "pad_token": name(tok.pad_id), "model_max_length": model_max_length, "clean_up_tokenization_spaces": False})
    if chat_template:  # the run's own template; transformers, like data.chat, reads chat_template.jinja first
        (out_dir / "chat_template.jinja").write_text(Path(chat_template).expanduser().read_text())


def token_ids(out_dir: Path) -> dict[str, int | None]:
    """bos/eos/pad ids of the folder's tokenizer (as parallel3d reads them: data/tokenizer.py)."""
    tok = load_tokenizer(str(out_dir))
    return {"bos": tok.bos_id, "eos": tok.eos_id, "pad": tok.pad_id}


def end_token_ids(*, tokenizer_spec: str, chat_template: str | None = None) -> list[int]:
    """Where generation ends for a run's tokenizer: eos, then the chat template's end-of-turn tokens
    that are other tokens (Qwen3 base: <|endoftext|> and <|im_end|>). ``chat_template``: the run's
    data.chat_template file, which replaces the tokenizer folder's template. What
    generation_config.json lists, and what parallel3d-generate stops at on the run's checkpoints."""
    tok = load_tokenizer(tokenizer_spec)
    found = load_chat_template(tokenizer_spec=tokenizer_spec, template_file=chat_template)
    template = found.source if found else ""
    token_id = getattr(tok, "token_id", lambda token: None)  # the byte tokenizer has no named tokens
    return [tok.eos_id] + [i for token in END_OF_TURN if token in template
                           for i in [token_id(token)] if i is not None and i != tok.eos_id]


def generation_config(out_dir: Path, ids: dict[str, int | None]) -> dict:
    """Stop where ``end_token_ids`` says, for the folder's own tokenizer and template."""
    ends = end_token_ids(tokenizer_spec=str(out_dir))
    return {"bos_token_id": ids["bos"], "eos_token_id": ends[0] if len(ends) == 1 else ends,
            "pad_token_id": ids["pad"] if ids["pad"] is not None else ids["eos"], "do_sample": False}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character (what ByteLevel pre-tokenizes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def byte_tokenizer_json() -> dict:
    """A tokenizer.json that is ByteTokenizer: byte b is token b, ``<|endoftext|>`` is 256 (no merges,
    no regex split, no prefix space), built with the tokenizers library."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_EOS, special=True)])
    assert tok.token_to_id(BYTE_EOS) == ByteTokenizer.eos_id
    return json.loads(tok.to_str())
