"""Tiny Hugging Face folders for tests, made the way a hub download looks: transformers'
``save_pretrained`` of a random model (config.json + model.safetensors) and of a tokenizer made
with the ``tokenizers`` library (tokenizer.json, tokenizer_config.json with a chat template).
No hub access: everything is built here."""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3's template, shortened: turns in <|im_start|>role ... <|im_end|>.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["def main():\n    return 0\n", "the quick brown fox jumps over the lazy dog", "import os\nimport sys\n",
        "class Model:\n    pass\n", "for i in range(10):\n    print(i)\n"]


def tiny_tokenizer(folder: Path, *, eos: str = "<|im_end|>") -> Path:
    """A byte-level BPE of ~300 tokens with Qwen-style special tokens, saved as transformers does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)
    return folder


def tiny_qwen3(folder: Path, *, moe: bool = False, seed: int = 0, eos: str = "<|im_end|>", max_shard_size: str = "5GB",
               **overrides) -> Path:
    """A random tiny Qwen3 (or Qwen3-MoE) folder with its tokenizer; ``overrides`` go to the config.
    A small ``max_shard_size`` makes several safetensors files and an index, as large hub models have."""
    import transformers

    tiny_tokenizer(folder, eos=eos)
    vocab = transformers.AutoTokenizer.from_pretrained(folder)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=not moe,
                  initializer_range=0.2, eos_token_id=vocab.eos_token_id, pad_token_id=vocab.pad_token_id)
    if moe:  # a wide init: decisive routing (no near-ties for float32 rounding to flip between implementations)
        config = transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             decoder_sparse_step=1, norm_topk_prob=True, **overrides)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.Qwen3Config(**common, **overrides)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    cls(config).eval().save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def tiny_deepseek_v3(folder: Path, *, seed: int = 0, **overrides) -> Path:
    """A random tiny DeepSeek-V3 folder (multi-head latent attention with low-rank queries, a dense first
    block, then routed and shared experts) with the tokenizer of ``tiny_tokenizer``."""
    import transformers

    tiny_tokenizer(folder)
    vocab = transformers.AutoTokenizer.from_pretrained(folder)
    config = transformers.DeepseekV3Config(**{
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16,
        "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "first_k_dense_replace": 1, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "initializer_range": 0.2, "eos_token_id": vocab.eos_token_id,
        "pad_token_id": vocab.pad_token_id, **overrides})
    torch.manual_seed(seed)
    transformers.DeepseekV3ForCausalLM(config).eval().save_pretrained(folder)
    return folder


def token_batch(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))
