#!/usr/bin/env python
"""Generate text with a trained model (any checkpoint, any layout it was saved at) in one process.

    parallel3d-generate RUN_DIR_OR_CHECKPOINT --prompt TEXT [--chat] [--max-new-tokens N]
                        [--temperature T] [--top-p P] [--seed S] [--token-ids]
                        [--prompt-ids "1 2 3"] [--device cpu|cuda] [--dtype float32|bfloat16]

RUN_DIR_OR_CHECKPOINT: a run_dir or its checkpoints/ folder (the newest complete checkpoint that
verifies) or one step_<N> folder. The model is the one the checkpoint's config.yaml describes; the
tokenizer is its run's data.tokenizer (``byte`` or a Hugging Face tokenizer). A Hugging Face folder
works too, read as ``checkpoint.init_from`` reads it (its config.json and tokenizer, if it has one). Greedy at
--temperature 0 (the default), else sampled with --top-p and --seed. Generation stops at the
tokenizer's end-of-text token (with --chat also at the chat template's end of turn) or after
--max-new-tokens. --token-ids prints the generated ids instead of text; --prompt-ids gives the
prompt as ids, for a run whose tokenizer is not on this machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from parallel3d.base import DTYPES, RunError
from parallel3d.config.hf_folder import is_hf_dir
from parallel3d.data.tokenizer import load_tokenizer, tokenizer_file
from parallel3d.inference.generate import generate, load_hf_model, load_model, resolve_checkpoint, saved_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="parallel3d-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a run_dir, a checkpoints/ folder or a step_<N> folder")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the text to continue")
    prompt.add_argument("--prompt-ids", help="the prompt as token ids separated by spaces or commas")
    parser.add_argument("--chat", action="store_true",
                        help="render the prompt as a user turn with the tokenizer folder's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of tokens this likely")
    parser.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    parser.add_argument("--token-ids", action="store_true", help="print the generated ids, not text")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--verify", choices=("checksum", "size", "none"), default="checksum",
                        help="how the checkpoint's files are checked before loading (checkpoint.verify)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    if args.chat and args.prompt is None:
        parser.error("--chat renders --prompt text: give --prompt")
    return args


def open_tokenizer(spec: str, *, needed: bool):
    """The run's tokenizer, or None where its file is not on this machine and ids will do."""
    try:
        return load_tokenizer(spec)
    except (OSError, ValueError) as e:
        if needed:
            raise RunError(f"the run's tokenizer {spec} cannot be read ({e}). Fix: copy it there, or give "
                           f"--prompt-ids and --token-ids") from e
        print(f"parallel3d-generate: note: no tokenizer ({spec} cannot be read): no end-of-text stop",
              file=sys.stderr)
        return None


def prompt_and_stops(args: argparse.Namespace, tokenizer, saved) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's ids and the ids that end generation."""
    stops = () if tokenizer is None else (tokenizer.eos_id,)
    if args.prompt_ids is not None:
        return [int(t) for t in args.prompt_ids.replace(",", " ").split()], stops
    if args.chat:
        return chat_prompt(args.prompt, tokenizer, saved)
    ids = tokenizer.encode(args.prompt)
    if tokenizer.bos_id is not None:  # documents start with it in training
        ids = [tokenizer.bos_id, *ids]
    return ids, stops


def chat_prompt(text: str, tokenizer, saved) -> tuple[list[int], tuple[int, ...]]:
    """``text`` as a user turn in the run's chat template, the assistant's turn opened; generation
    also stops at the template's end-of-turn token (``<|eot_id|>``, ``<|im_end|>``)."""
    from parallel3d.data.chat import chat_token_ids, end_of_turn_text, load_chat_template

    spec = str(saved.data.tokenizer)
    template = load_chat_template(tokenizer_spec=spec, template_file=saved.data.get("chat_template"))
    if template is None:
        raise RunError(f"--chat: the tokenizer {spec} has no chat template (chat_template.jinja or "
                       f"tokenizer_config.json). Fix: give --prompt without --chat")
    ids = chat_token_ids(tokenizer=tokenizer, template=template, messages=[{"role": "user", "content": text}],
                         add_generation_prompt=True)
    end_of_turn = tokenizer.encode(end_of_turn_text(template))  # one special token in the templates we know
    stops = (tokenizer.eos_id, *end_of_turn) if len(end_of_turn) == 1 else (tokenizer.eos_id,)
    return ids, stops


def open_model(args: argparse.Namespace):
    """(the model, the config it trained or was imported with, where it came from, the tokenizer)."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    needed = not (args.prompt_ids and args.token_ids)
    if is_hf_dir(args.checkpoint):
        model, saved = load_hf_model(args.checkpoint, device=device, dtype=dtype)
        if not tokenizer_file(args.checkpoint).is_file():  # a folder with weights and config.json only
            if needed:
                raise RunError(f"{args.checkpoint} has no tokenizer.json. Fix: give --prompt-ids and --token-ids")
            return model, saved, args.checkpoint, None
        return model, saved, args.checkpoint, open_tokenizer(str(saved.data.tokenizer), needed=needed)
    step_dir = resolve_checkpoint(args.checkpoint, verify=args.verify)
    saved = saved_config(step_dir)
    tokenizer = open_tokenizer(str(saved.data.tokenizer), needed=needed)
    return load_model(step_dir, device=device, dtype=dtype), saved, step_dir, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        model, saved, step_dir, tokenizer = open_model(args)
        prompt, stops = prompt_and_stops(args, tokenizer, saved)
        ids = generate(model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, stop_ids=stops, seed=args.seed)
    except (RunError, ValueError) as e:
        print(f"parallel3d-generate: {e}", file=sys.stderr)
        return 1
    print(f"parallel3d-generate: {step_dir}, {len(prompt)} prompt tokens, {len(ids)} generated", file=sys.stderr)
    if args.token_ids:
        print(" ".join(map(str, ids)))
    else:
        print(tokenizer.decode([i for i in ids if i not in stops]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
