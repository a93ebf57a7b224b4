"""Tokenizers: raw bytes (needs nothing) or a local Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import hashlib
from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and 256 as the end-of-document token."""

    vocab_size = 257
    eos_id = 256
    bos_id = None
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizer.json`` read by the ``tokenizers`` library; nothing is downloaded."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(Path(path).expanduser()))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos()
        # Documents start with it where the tokenizer has one (Llama 3's <|begin_of_text|>).
        self.bos_id = next((i for i in map(self._tok.token_to_id, ("<|begin_of_text|>", "<s>", "<bos>"))
                            if i is not None), None)

    def _find_eos(self) -> int:
        for token in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]"):
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(f"{self.name}: no end-of-text token found (looked for <|end_of_text|>, </s>, ...)")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The tokenizers library's own batch encoding (Rust, parallel over the batch)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's character span in ``text`` (chat masks map characters to tokens)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def tokenizer_hash(spec: str) -> str:
    """What identifies a tokenizer: ``byte``, or the SHA-256 of its tokenizer.json (a file moved
    or renamed is the same tokenizer; one edited in place is another)."""
    if spec == "byte":
        return "byte"
    return hashlib.sha256(Path(spec).expanduser().read_bytes()).hexdigest()


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
