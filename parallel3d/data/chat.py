"""Chat templates: render conversations exactly as Hugging Face transformers does, to token ids.

A tokenizer folder carries its chat template (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``) and its special tokens. ``render_chat`` reproduces transformers'
jinja2 environment (sandboxed, ``trim_blocks``/``lstrip_blocks``, its ``tojson``,
``raise_exception``, ``strftime_now``, the special tokens as variables) and ``chat_token_ids``
tokenizes the text without adding special tokens, which gives the ids of transformers'
``apply_chat_template(messages, tokenize=True)["input_ids"]``.

``chat_ids_and_mask`` also marks the tokens of the assistant turns, for a loss on them only: a
template's ``{% generation %}...{% endgeneration %}`` blocks where it has them (transformers'
``return_assistant_tokens_mask``), else each assistant turn as the conversation locates it.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from parallel3d.data.tokenizer import tokenizer_folder

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_PROBE = "\x00assistant-reply\x00"
_GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")  # transformers' test for the blocks


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's source and the special tokens the template may read (``bos_token``...)."""

    source: str
    special_tokens: dict[str, str] = field(default_factory=dict)
    origin: str = ""  # the file it came from, for messages

    def __hash__(self) -> int:
        return hash((self.source, tuple(sorted(self.special_tokens.items()))))


def template_folder(tokenizer_spec: str) -> Path | None:
    """Where a tokenizer's chat template may be: its folder (none for the byte tokenizer)."""
    return None if tokenizer_spec == "byte" else tokenizer_folder(tokenizer_spec)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_from_config(config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def load_chat_template(*, tokenizer_spec: str, template_file: str | None = None) -> ChatTemplate | None:
    """The template ``template_file`` holds, else the tokenizer folder's own (``chat_template.jinja``
    first, as transformers reads it, then tokenizer_config.json); None where there is none."""
    folder = template_folder(tokenizer_spec)
    config_path = folder / "tokenizer_config.json" if folder else None
    config = json.loads(config_path.read_text()) if config_path and config_path.is_file() else {}
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    if template_file:
        path = Path(template_file).expanduser()
        return ChatTemplate(source=path.read_text(), special_tokens=special, origin=str(path))
    if folder is None:
        return None
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(source=jinja_file.read_text(), special_tokens=special, origin=str(jinja_file))
    source = _template_from_config(config)
    return ChatTemplate(source=source, special_tokens=special, origin=str(config_path)) if source else None


@lru_cache(maxsize=8)
def _compiled(source: str):
    """transformers' own environment (utils/chat_template_utils.py ``_compile_jinja_template``)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_tracker(), loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _generation_tracker():
    """transformers' ``AssistantTracker``: ``{% generation %}...{% endgeneration %}`` renders its
    body and, while ``environment.track_generation(blocks, spans)`` is active, notes the body's
    character span in the text rendered so far."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationTracker(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track_generation=self.track)
            self._tracking = ContextVar("generation_tracker", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context, caller) -> str:
            text = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        @contextmanager
        def track(self, blocks: list[str], spans: list[tuple[int, int]]):
            token = self._tracking.set((blocks, spans))
            try:
                yield
            finally:
                self._tracking.reset(token)

    return GenerationTracker


def has_generation_blocks(template: ChatTemplate) -> bool:
    """Whether the template marks the tokens to train with ``{% generation %}`` blocks."""
    return bool(_GENERATION_TAG.search(template.source))


def _with_reasoning_aliases(messages: list[dict]) -> list[dict]:
    """transformers fills ``reasoning_content`` and ``thinking`` from whichever of them a message has."""
    out = []
    for message in messages:
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                          if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(dict(message))
    return out


def render_chat(*, template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = False,
                **template_kwargs: Any) -> str:
    """The conversation as text, as transformers' ``apply_chat_template(..., tokenize=False)``."""
    variables = {**template.special_tokens, **template_kwargs}
    return _compiled(template.source).render(messages=_with_reasoning_aliases(messages), tools=None,
                                             documents=None, add_generation_prompt=add_generation_prompt,
                                             **variables)


def chat_token_ids(*, tokenizer, template: ChatTemplate, messages: list[dict],
                   add_generation_prompt: bool = False) -> list[int]:
    """The ids of transformers' ``apply_chat_template(messages, tokenize=True)["input_ids"]``: the
    rendered text tokenized without added special tokens (the template writes BOS where it wants one)."""
    return tokenizer.encode(render_chat(template=template, messages=messages,
                                        add_generation_prompt=add_generation_prompt))


@lru_cache(maxsize=8)
def end_of_turn_text(template: ChatTemplate) -> str:
    """The text the template closes an assistant turn with (``<|eot_id|>``, ``<|im_end|>``): what it
    writes after the reply of a final assistant message, trailing whitespace left out."""
    text = render_chat(template=template, messages=[{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": _PROBE}])
    if _PROBE not in text:
        raise ValueError(f"{template.origin}: the chat template does not write the assistant's reply")
    end_of_turn = text[text.rindex(_PROBE) + len(_PROBE):].rstrip()
    if not end_of_turn:
        raise ValueError(f"{template.origin}: the chat template writes nothing after an assistant reply, "
                         "so where a turn ends is unknown")
    return end_of_turn


def assistant_spans(*, template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn in it: the
    template's ``{% generation %}`` blocks where it has them (as transformers marks them), else:

    A turn starts where the conversation before it, rendered with the generation prompt, ends:
    that prefix is exactly what the model sees when it is asked for this reply, so the reply and
    all the template writes after the prompt (Qwen3's ``<think>`` block of the final turn) are
    trained. It ends after the template's end-of-turn text. Rendering message prefixes up to the
    turn's end instead would go wrong for templates that render the final assistant turn
    differently from earlier ones (Qwen3 drops the reasoning of turns before the last query).
    """
    if has_generation_blocks(template):
        return generation_spans(template=template, messages=messages)
    text = render_chat(template=template, messages=messages)
    end_of_turn = end_of_turn_text(template)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render_chat(template=template, messages=messages[:i], add_generation_prompt=True)
        if not text.startswith(prompt):
            raise ValueError(f"{template.origin}: the conversation before assistant turn {i} renders differently "
                             "on its own; this template's assistant turns cannot be located")
        stop = text.find(end_of_turn, len(prompt))
        spans.append((len(prompt), len(text) if stop < 0 else stop + len(end_of_turn)))
    return text, spans


def generation_spans(*, template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each ``{% generation %}`` block in it,
    as transformers renders them for its assistant masks (block by block, with the tracker on)."""
    compiled = _compiled(template.source)
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    with compiled.environment.track_generation(blocks, spans):
        for block in compiled.generate(messages=_with_reasoning_aliases(messages), tools=None, documents=None,
                                       add_generation_prompt=False, **template.special_tokens):
            blocks.append(block)
    return "".join(blocks), spans


def chat_ids_and_mask(*, tokenizer, template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids (as ``chat_token_ids``) and, per token, whether it belongs to an assistant turn
    (a token overlapping a turn's characters does, as in transformers' assistant masks)."""
    text, spans = assistant_spans(template=template, messages=messages)
    ids, offsets = tokenizer.encode_with_offsets(text)
    mask, span = [], 0
    for start, end in offsets:
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        mask.append(span < len(spans) and end > spans[span][0])
    return ids, mask
