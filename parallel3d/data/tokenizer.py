"""Tokenizers: raw bytes (needs nothing) or a local Hugging Face tokenizer.

``data.tokenizer`` is ``byte``, a ``tokenizer.json``, or a folder holding one (a Hugging Face model
or tokenizer folder). The special tokens come from the folder's ``tokenizer_config.json`` /
``special_tokens_map.json`` when it has them (Qwen3 instruct ends a turn and a document with
``<|im_end|>``, Llama 3 starts one with ``<|begin_of_text|>``), else from well-known token names.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"
# The files of a tokenizer folder that change token ids: vocabulary and merges, special tokens, chat template.
ID_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, and 256 as the end-of-document token."""

    vocab_size = 257
    eos_id = 256
    bos_id = None
    pad_id = None
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_with_special_tokens(self, text: str) -> list[int]:
        return self.encode(text)  # nothing added: its exported tokenizer.json has no post-processor

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def tokenizer_folder(spec: str | Path) -> Path:
    """The folder of a tokenizer: ``spec`` itself when it is one, else the folder of its tokenizer.json."""
    path = Path(spec).expanduser()
    return path if path.is_dir() else path.parent


def tokenizer_file(spec: str | Path) -> Path:
    path = Path(spec).expanduser()
    return path / TOKENIZER_FILE if path.is_dir() else path


def special_tokens(folder: Path) -> dict[str, str | None]:
    """``bos_token``/``eos_token``/``pad_token`` as the folder's tokenizer_config.json (first) and
    special_tokens_map.json declare them; a key neither declares is absent (null: declared none)."""
    found: dict[str, str | None] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins: transformers' order
        path = folder / name
        if not path.is_file():
            continue
        declared = json.loads(path.read_text())
        for key in ("bos_token", "eos_token", "pad_token"):
            if key in declared:
                value = declared[key]
                found[key] = value.get("content") if isinstance(value, dict) else value
    return found


class HFTokenizer:
    """A ``tokenizer.json`` (or a folder holding one) read by the ``tokenizers`` library; nothing is downloaded."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(tokenizer_file(path)))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        declared = special_tokens(tokenizer_folder(path)) if Path(path).expanduser().is_dir() else {}
        self.eos_id = self._declared(declared, "eos_token") if "eos_token" in declared else self._search(_EOS_NAMES)
        if self.eos_id is None:
            raise ValueError(f"{self.name}: no end-of-text token found (looked for eos_token in tokenizer_config.json, "
                             f"{', '.join(_EOS_NAMES)})")
        # Documents start with it where the tokenizer has one (Llama 3's <|begin_of_text|>).
        self.bos_id = self._declared(declared, "bos_token") if "bos_token" in declared else self._search(_BOS_NAMES)
        self.pad_id = self._declared(declared, "pad_token")

    def _declared(self, declared: dict, key: str) -> int | None:
        token = declared.get(key)
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.name}: its {key} {token!r} is not in {TOKENIZER_FILE}")
        return token_id

    def _search(self, names: tuple[str, ...]) -> int | None:
        return next((i for i in map(self._tok.token_to_id, names) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """As transformers' ``tokenizer(text)["input_ids"]``: with the special tokens the tokenizer's
        post-processor adds (Llama 3's BOS first; none for tokenizers without one)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The tokenizers library's own batch encoding (Rust, parallel over the batch)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's character span in ``text`` (chat masks map characters to tokens)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def tokenizer_hash(spec: str) -> str:
    """What identifies a tokenizer: ``byte``, or the SHA-256 of its tokenizer.json (a file moved
    or renamed is the same tokenizer; one edited in place is another). A folder: of the files that
    change token ids, by name; one holding only tokenizer.json hashes as that file does."""
    if spec == "byte":
        return "byte"
    path = Path(spec).expanduser()
    if not path.is_dir():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    present = [name for name in ID_FILES if (path / name).is_file()]
    if present == [TOKENIZER_FILE]:
        return hashlib.sha256((path / TOKENIZER_FILE).read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for name in present:
        data = (path / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
