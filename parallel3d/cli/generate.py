#!/usr/bin/env python
"""Generate text in one process from a trained model: a checkpoint (any layout it was saved at), a run_dir, or a Hugging Face folder.

    parallel3d-generate MODEL --prompt TEXT [--chat] [--max-new-tokens N]
                        [--temperature T] [--top-p P] [--seed S] [--token-ids]
                        [--prompt-ids "1 2 3"] [--device cpu|cuda] [--dtype float32|bfloat16]
    parallel3d-generate MODEL --prompts-file FILE.jsonl [--batch-size B] [the options above]

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

--prompts-file: one JSON object a line, with "prompt" (text; with --chat a user turn) or
"prompt_ids" (a list of ids); one output line per prompt, in the file's order: the generated text
as a JSON string, or with --token-ids the ids. The prompts are decoded --batch-size at a time,
left-padded, similar lengths together; each gets the ids it gets alone (greedy), and each stops at
the end tokens on its own. With --temperature > 0, prompt i of the file samples with --seed + i.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from parallel3d.base import DTYPES, RunError
from parallel3d.inference.generate import generate_in_batches
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
    prompt.add_argument("--prompts-file", type=Path, metavar="FILE.jsonl",
                        help='many prompts: one JSON object a line with "prompt" (text) or "prompt_ids" (ids)')
    parser.add_argument("--batch-size", type=int, default=16, help="prompts of --prompts-file decoded together")
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
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1 or args.batch_size < 1:
        parser.error("--max-new-tokens >= 1, --temperature >= 0, 0 < --top-p <= 1 and --batch-size >= 1")
    if args.chat and args.prompt is None and args.prompts_file is None:
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


def read_requests(args: argparse.Namespace) -> list[dict]:
    """The prompts as records, ``{"prompt": text}`` or ``{"prompt_ids": [ids]}``: the one of
    --prompt / --prompt-ids, or each line of --prompts-file (RunError naming a bad line)."""
    if args.prompt_ids is not None:
        return [{"prompt_ids": [int(t) for t in args.prompt_ids.replace(",", " ").split()]}]
    if args.prompts_file is None:
        return [{"prompt": args.prompt}]
    path, requests = args.prompts_file.expanduser(), []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise RunError(f"{path}: cannot be read ({e.strerror}). Fix: give a JSON lines file of prompts") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        ids = record.get("prompt_ids") if isinstance(record, dict) else None
        if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            requests.append({"prompt_ids": ids})
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            requests.append({"prompt": record["prompt"]})
        else:
            raise RunError(f'{path} line {number}: not a JSON object with "prompt" (text) or "prompt_ids" (a list '
                           f'of ids). Fix: write each line as {{"prompt": "..."}} or {{"prompt_ids": [1, 2]}}')
    if not requests:
        raise RunError(f"{path}: no prompt in it. Fix: give one JSON object a line")
    return requests


def encode(requests: list[dict], args: argparse.Namespace, tokenizer,
           trained: Trained) -> tuple[list[list[int]], frozenset[int]]:
    """Each prompt's ids, and the ids that end generation (with --chat the template's end of turn too)."""
    stops, prompts = trained.end_ids(tokenizer), []
    for request in requests:
        if "prompt_ids" in request:
            prompts.append(request["prompt_ids"])
        elif args.chat:
            ids, end_of_turn = chat_prompt(request["prompt"], tokenizer, trained)
            prompts.append(ids)
            stops |= end_of_turn
        else:  # documents start with BOS in training, where the tokenizer has one
            bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
            prompts.append([*bos, *tokenizer.encode(request["prompt"])])
    return prompts, stops


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


def open_model(args: argparse.Namespace, *, needs_tokenizer: bool) -> tuple[Trained, object]:
    """The model the command names and its tokenizer (None where ids in and out will do without one)."""
    trained = open_trained(args.checkpoint, device=torch.device(args.device), dtype=DTYPES[args.dtype],
                           verify=args.verify)
    tokenizer = read_tokenizer(trained.tokenizer_spec, needed=needs_tokenizer)
    if tokenizer is None and not trained.end_ids(None):
        print(f"parallel3d-generate: note: no tokenizer ({trained.tokenizer_spec or trained.origin} has none "
              f"here): no end-of-text stop", file=sys.stderr)
    return trained, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        requests = read_requests(args)
        text_in = any("prompt" in r for r in requests)
        trained, tokenizer = open_model(args, needs_tokenizer=text_in or not args.token_ids)
        prompts, stops = encode(requests, args, tokenizer, trained)
        start = time.perf_counter()
        outputs = generate_in_batches(trained.model, prompts, batch_size=args.batch_size,
                                      max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, stop_ids=stops, seed=args.seed)
        seconds = time.perf_counter() - start
    except (RunError, ValueError) as e:
        print(f"parallel3d-generate: {e}", file=sys.stderr)
        return 1
    generated = sum(len(ids) for ids in outputs)
    if args.prompts_file is None:
        print(f"parallel3d-generate: {trained.origin}, {len(prompts[0])} prompt tokens, {generated} generated",
              file=sys.stderr)
    else:
        print(f"parallel3d-generate: {trained.origin}, {len(prompts)} prompts, {generated} tokens generated in "
              f"{seconds:.1f} s ({generated / max(seconds, 1e-9):.1f} tokens/s, batches of {args.batch_size})",
              file=sys.stderr)
    for ids in outputs:
        if args.token_ids:
            print(" ".join(map(str, ids)))
        else:
            text = tokenizer.decode([i for i in ids if i not in stops])
            print(text if args.prompts_file is None else json.dumps(text, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
