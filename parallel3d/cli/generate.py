#!/usr/bin/env python
"""Generate text in one process from a trained model: a checkpoint (any layout it was saved at), a run_dir, or a Hugging Face folder.

    parallel3d-generate MODEL --prompt TEXT [--chat] [--max-new-tokens N]
                        [--temperature T] [--top-p P] [--seed S] [--token-ids]
                        [--prompt-ids "1 2 3"] [--device cpu|cuda] [--dtype float32|bfloat16]

MODEL: a run_dir or its checkpoints/ folder (the newest complete checkpoint that verifies), one
step_<N> folder, or a Hugging Face folder (config.json + *.safetensors, read as
``checkpoint.init_from`` reads it: its config.json and its tokenizer, if it has one); a run_dir
that kept no checkpoint is read from its export, run_dir/hf/. A checkpoint's model is the one its
config.yaml describes and its tokenizer the run's data.tokenizer. Greedy at --temperature 0 (the
default), else sampled with --top-p and --seed. Generation stops at every end token transformers'
generate stops at on the same model (a folder's generation_config.json eos_token_id; a run's: the
tokenizer's end of text and the chat template's end of turn, as its export lists them; with --chat
also the template's end of turn) or after --max-new-tokens. --token-ids prints the generated ids
instead of text; --prompt-ids gives the prompt as ids, for a model whose tokenizer is not here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from parallel3d.base import DTYPES, RunError
from parallel3d.inference.generate import generate
from parallel3d.inference.trained import Trained, open_tokenizer, open_trained


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="parallel3d-generate", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, metavar="MODEL",
                        help="a run_dir, a checkpoints/ folder, a step_<N> folder, or a Hugging Face folder "
                             "(config.json + *.safetensors; a run_dir that kept only hf/ is read from it)")
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


def read_tokenizer(spec: str | None, *, needed: bool):
    """The model's tokenizer, or None where it is not on this machine (or a folder has none) and ids will do."""
    try:
        if spec is None:
            raise OSError("the folder has no tokenizer.json")
        return open_tokenizer(spec)
    except (OSError, ValueError) as e:
        if needed:
            raise RunError(f"the tokenizer {spec} cannot be read ({e}). Fix: copy it there, or give "
                           f"--prompt-ids and --token-ids") from e
        return None


def prompt_and_stops(args: argparse.Namespace, tokenizer, trained: Trained) -> tuple[list[int], frozenset[int]]:
    """The prompt's ids and the ids that end generation."""
    stops = trained.end_ids(tokenizer)
    if args.prompt_ids is not None:
        return [int(t) for t in args.prompt_ids.replace(",", " ").split()], stops
    if args.chat:
        ids, end_of_turn = chat_prompt(args.prompt, tokenizer, trained)
        return ids, stops | end_of_turn
    ids = tokenizer.encode(args.prompt)
    if tokenizer.bos_id is not None:  # documents start with it in training
        ids = [tokenizer.bos_id, *ids]
    return ids, stops


def chat_prompt(text: str, tokenizer, trained: Trained) -> tuple[list[int], frozenset[int]]:
    """``text`` as a user turn in the model's chat template, the assistant's turn opened; and the
    template's end-of-turn token (``<|eot_id|>``, ``<|im_end|>``), where it is one token."""
    from parallel3d.data.chat import chat_token_ids, end_of_turn_text, load_chat_template

    spec = trained.tokenizer_spec
    template = load_chat_template(tokenizer_spec=spec, template_file=trained.config.data.get("chat_template"))
    if template is None:
        raise RunError(f"--chat: the tokenizer {spec} has no chat template (chat_template.jinja or "
                       f"tokenizer_config.json). Fix: give --prompt without --chat")
    ids = chat_token_ids(tokenizer=tokenizer, template=template, messages=[{"role": "user", "content": text}],
                         add_generation_prompt=True)
    end_of_turn = tokenizer.encode(end_of_turn_text(template))  # one special token in the templates we know
    return ids, frozenset(end_of_turn) if len(end_of_turn) == 1 else frozenset()


def open_model(args: argparse.Namespace) -> tuple[Trained, object]:
    """The model the command names and its tokenizer (None where ids in and out will do without one)."""
    trained = open_trained(args.checkpoint, device=torch.device(args.device), dtype=DTYPES[args.dtype],
                           verify=args.verify)
    tokenizer = read_tokenizer(trained.tokenizer_spec, needed=not (args.prompt_ids and args.token_ids))
    if tokenizer is None and not trained.end_ids(None):
        print(f"parallel3d-generate: note: no tokenizer ({trained.tokenizer_spec or trained.origin} has none "
              f"here): no end-of-text stop", file=sys.stderr)
    return trained, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        trained, tokenizer = open_model(args)
        prompt, stops = prompt_and_stops(args, tokenizer, trained)
        ids = generate(trained.model, prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, stop_ids=stops, seed=args.seed)
    except (RunError, ValueError) as e:
        print(f"parallel3d-generate: {e}", file=sys.stderr)
        return 1
    print(f"parallel3d-generate: {trained.origin}, {len(prompt)} prompt tokens, {len(ids)} generated",
          file=sys.stderr)
    if args.token_ids:
        print(" ".join(map(str, ids)))
    else:
        print(tokenizer.decode([i for i in ids if i not in stops]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
