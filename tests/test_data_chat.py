"""Chat rendering: the ids of transformers' apply_chat_template, and the assistant mask.

Llama 3's and Qwen3's templates (tests/harness/chat_files.py), multi-turn, with a system message and with
Qwen3's reasoning: its template drops the reasoning of turns before the last user message and
writes an empty <think> block into the final turn, which the mask must then cover.
"""

from __future__ import annotations

import pytest
from harness.chat_files import CONVERSATIONS, STYLES, chat_tokenizer_folder

from parallel3d.data.chat import chat_ids_and_mask, chat_token_ids, load_chat_template
from parallel3d.data.tokenizer import HFTokenizer

EOT = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>"}
# What each conversation's assistant turns are, as trained: the reply and its end-of-turn token.
REPLIES = {
    "llama3": [["Paris is the capital of France.", "<think>\nthe fox\n</think>\n\nSure, here is one: the quick brown fox."],
               ["Sure.", "The lazy dog.", "You are welcome."]],
    "qwen3": [["Paris is the capital of France.", "<think>\nthe fox\n</think>\n\nSure, here is one: the quick brown fox."],
              ["Sure.", "The lazy dog.", "<think>\n\n</think>\n\nYou are welcome."]],
}


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = chat_tokenizer_folder(tmp_path_factory.mktemp(request.param), request.param)
    ours = HFTokenizer(folder / "tokenizer.json")
    return request.param, AutoTokenizer.from_pretrained(str(folder)), ours, load_chat_template(tokenizer_spec=str(folder))


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_ids_equal_transformers(style, add_generation_prompt):
    name, reference, tokenizer, template = style
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=True,
                                                 add_generation_prompt=add_generation_prompt)["input_ids"]
        assert chat_token_ids(tokenizer=tokenizer, template=template, messages=messages,
                              add_generation_prompt=add_generation_prompt) == expected
        ids, _ = chat_ids_and_mask(tokenizer=tokenizer, template=template, messages=messages)
        if not add_generation_prompt:
            assert ids == expected
            eot = reference.convert_tokens_to_ids(EOT[name])
            assert not any(a == b == eot for a, b in zip(ids, ids[1:])), "no double end of turn"


@pytest.mark.fast
def test_mask_is_exactly_the_assistant_turns(style):
    name, reference, tokenizer, template = style
    for messages, replies in zip(CONVERSATIONS, REPLIES[name]):
        ids, mask = chat_ids_and_mask(tokenizer=tokenizer, template=template, messages=messages)
        runs, current = [], []
        for token, trained in zip(ids, mask):
            if trained:
                current.append(token)
            elif current:
                runs.append(current)
                current = []
        runs += [current] if current else []
        assert [reference.decode(run) for run in runs] == [reply + EOT[name] for reply in replies]


def test_template_file_overrides_the_folder(tmp_path, style):
    name, _, _, _ = style
    folder = chat_tokenizer_folder(tmp_path / name, name)
    other = tmp_path / "other.jinja"
    other.write_text(STYLES["qwen3" if name == "llama3" else "llama3"]["template"])
    template = load_chat_template(tokenizer_spec=str(folder / "tokenizer.json"), template_file=str(other))
    assert template.source == other.read_text() and template.special_tokens["eos_token"] == STYLES[name]["eos"]
    assert load_chat_template(tokenizer_spec="byte") is None


# Llama 3's template with transformers' assistant-mask markers around each reply (its end of turn
# left outside them: the mask must be the blocks', not the turns').
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}{% endif %}{{ '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_generation_blocks_render_and_mask_as_transformers(tmp_path):
    """A template with {% generation %} blocks renders as transformers renders it, and the mask is
    transformers' assistant mask (return_assistant_tokens_mask): the blocks' tokens."""
    import json

    from transformers import AutoTokenizer

    folder = chat_tokenizer_folder(tmp_path / "tok", "llama3")
    config = json.loads((folder / "tokenizer_config.json").read_text()) | {"chat_template": GENERATION_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    reference, ours = AutoTokenizer.from_pretrained(str(folder)), HFTokenizer(folder / "tokenizer.json")
    template = load_chat_template(tokenizer_spec=str(folder))
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
        ids, mask = chat_ids_and_mask(tokenizer=ours, template=template, messages=messages)
        assert ids == expected["input_ids"] and [int(m) for m in mask] == expected["assistant_masks"]
        assert sum(mask) and not any(m for i, m in zip(ids, mask) if i == reference.convert_tokens_to_ids("<|eot_id|>"))
