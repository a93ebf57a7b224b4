"""Tiny Hugging Face tokenizer folders with chat templates, built in-test (no hub access).

The templates are the Llama 3 Instruct template and Qwen3's (without its tool branches), as
their tokenizer_config.json files ship them.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

STYLES = {
    "llama3": dict(template=LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|eot_id|>",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"], added=[]),
    # Qwen3's eos is <|im_end|> (its end of turn); <think> and </think> are added tokens, not special.
    "qwen3": dict(template=QWEN3_TEMPLATE, bos=None, eos="<|im_end|>",
                  special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=["<think>", "</think>"]),
}

CORPUS = ["You are a helpful assistant.", "What is the capital of France? Paris is the capital of France.",
          "Tell me a joke about the quick brown fox that jumps over the lazy dog.", "Sure, here is one."]


def chat_tokenizer_folder(folder: Path, style: str) -> Path:
    """A tokenizer folder (tokenizer.json + tokenizer_config.json with its chat template) that
    transformers' AutoTokenizer and parallel3d both read."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": spec["template"],
              "eos_token": spec["eos"], "bos_token": spec["bos"], "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder


CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."},
     {"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "<think>\nthe fox\n</think>\n\nSure, here is one: the quick brown fox."}],
    [{"role": "user", "content": "Tell me a joke."},
     {"role": "assistant", "content": "Sure."},
     {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "The lazy dog.", "reasoning_content": "dogs"},
     {"role": "user", "content": "Thanks"},
     {"role": "assistant", "content": "You are welcome."}],
]

WORDS = " ".join(CORPUS).replace(".", "").replace("?", "").replace(",", "").split()


def chat_records(count: int, seed: int = 0, long_prompts: int = 0) -> list[dict]:
    """``count`` chat records (system or not, one to three turns) and ``long_prompts`` more whose
    user message alone overflows a 65-token row, so their rows train no token."""
    import random

    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    records = []
    for i in range(count):
        messages = [{"role": "system", "content": text(2, 5)}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 2)):
            messages += [{"role": "user", "content": text(1, 3)}, {"role": "assistant", "content": text(1, 5)}]
        records.append({"messages": messages})
    for _ in range(long_prompts):
        records.append({"messages": [{"role": "user", "content": text(80, 90)}, {"role": "assistant", "content": "Sure."}]})
    rng.shuffle(records)
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=2048, tie_word_embeddings=False)


def llama_folder(folder: Path, style: str = "llama3", seed: int = 0) -> Path:
    """A tiny Llama (random weights, float32) saved by transformers, with a chat tokenizer beside it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, torch_dtype="float32"))
    model.save_pretrained(folder, safe_serialization=True)
    return chat_tokenizer_folder(folder, style)


def llama3_instruct_folder(folder: Path, seed: int = 0) -> Path:
    """A tiny Llama 3 Instruct as its first release shipped: the tokenizer's post-processor adds
    <|begin_of_text|> (transformers' ``tokenizer(text)`` starts with BOS), eos_token is
    <|end_of_text|>, the chat template ends each turn with <|eot_id|>, and generation_config.json
    lists both as end tokens (transformers' generate stops at either)."""
    from tokenizers import Tokenizer, processors

    llama_folder(folder, "llama3", seed)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bos, eos, eot = (tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text()) | {"eos_token": "<|end_of_text|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    model = json.loads((folder / "config.json").read_text()) | {"bos_token_id": bos, "eos_token_id": eos}
    (folder / "config.json").write_text(json.dumps(model, indent=1))
    generation = {"bos_token_id": bos, "eos_token_id": [eos, eot], "do_sample": False}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=1))
    return folder
