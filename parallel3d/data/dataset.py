"""Token files: a flat array of token ids on disk, memory-mapped for training.

``NAME.bin`` holds the tokens (uint16 when the vocabulary fits, else uint32) and ``NAME.json``
beside it says how to read them. Documents are concatenated, each followed by the tokenizer's
end-of-text token. Files are written to a temporary name and renamed, so a reader never sees
half a file even when several ranks prepare the same corpus at once.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from parallel3d.base import RunError
from parallel3d.data.integrity import DIGEST, token_file_problem
from parallel3d.progress import Progress


def write_token_file(documents: Iterable[str], tokenizer, output: str | Path, progress=None,
                     extra_meta: dict | None = None, batch_docs: int = 256) -> Path:
    """Tokenize ``documents`` (in batches, with the tokenizer's batch encoder) into ``output``:
    [BOS] document EOS, for each document. The sidecar .json is written last: its presence
    means the token file is complete, and it is the file's manifest (size and checksum)."""
    dtype = token_dtype(tokenizer)
    bos = [] if getattr(tokenizer, "bos_id", None) is None else [tokenizer.bos_id]

    def chunks():
        for batch in _batches(documents, batch_docs):
            encoded = (tokenizer.encode_batch(batch) if hasattr(tokenizer, "encode_batch")
                       else map(tokenizer.encode, batch))
            yield np.fromiter((i for doc in encoded for i in (*bos, *doc, tokenizer.eos_id)), dtype=dtype)

    meta = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, **(extra_meta or {})}
    return write_array_file(chunks(), dtype, output, meta, progress)


def token_dtype(tokenizer) -> type:
    return np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32


def write_array_file(chunks: Iterable[np.ndarray], dtype, output: str | Path, meta: dict, progress=None) -> Path:
    """``chunks`` one after another into ``output`` as ``dtype``, and its manifest ``output``.json
    (dtype, count, size, checksum, ``meta``), written last: its presence means complete. A full
    disk is a RunError naming the file and the fix (a bare OSError names neither)."""
    output = Path(output).expanduser()
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    meta_tmp = tmp.with_suffix(".json.tmp")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        count, digest = _write_chunks(chunks, dtype, tmp, progress)
        meta = {"dtype": np.dtype(dtype).name, "num_tokens": count, "bytes": count * np.dtype(dtype).itemsize,
                DIGEST: digest, **meta}
        meta_tmp.write_text(json.dumps(meta, indent=1))
    except BaseException as e:  # bad input, a stop signal, a full disk: leave no half-written file behind
        tmp.unlink(missing_ok=True)
        meta_tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise RunError(f"disk full writing {output}: free space on its file system, or set data.cache_dir "
                           f"to a folder with room, and run again (finished files are kept)") from e
        raise
    os.replace(tmp, output)
    os.replace(meta_tmp, output.with_suffix(".json"))  # written last: its presence means complete
    return output


def _write_chunks(chunks: Iterable[np.ndarray], dtype, path: Path, progress) -> tuple[int, str]:
    """Write ``chunks`` to ``path``; returns their element count and checksum."""
    count, digest = 0, hashlib.new(DIGEST)
    with open(path, "wb") as f:
        for chunk in chunks:
            data = np.asarray(chunk, dtype=dtype).tobytes()
            f.write(data)
            digest.update(data)
            count += len(chunk)
            if progress is not None:
                progress(count)
    return count, digest.hexdigest()


def _batches(items: Iterable[str], size: int) -> Iterable[list[str]]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class TokenFile:
    """Read-only view of a token file; ``tokens[a:b]`` reads only those bytes from disk."""

    def __init__(self, path: str | Path):
        path = Path(path).expanduser()
        meta_path = path.with_suffix(".json")
        if not meta_path.is_file():
            raise FileNotFoundError(f"{meta_path} is missing: was {path} written by parallel3d-prepare-data?")
        try:
            self.meta = json.loads(meta_path.read_text())
            expected = self.meta["num_tokens"] * np.dtype(self.meta["dtype"]).itemsize
        except (ValueError, KeyError, TypeError) as e:
            raise RunError(f"{meta_path} is corrupt ({type(e).__name__}). Fix: write {path} again with "
                           f"parallel3d-prepare-data") from e
        size = path.stat().st_size if path.is_file() else None
        if size != expected:  # a short file would fail inside np.memmap, naming neither file nor fix
            raise RunError(f"{path} is {size} bytes but {meta_path.name} says {expected} (truncated, or written "
                           f"by another run). Fix: write it again with parallel3d-prepare-data")
        self.path = path
        # An empty file (a shard whose documents were all held out, or none were) cannot be mapped.
        self.tokens = (np.memmap(path, dtype=self.meta["dtype"], mode="r", shape=(self.meta["num_tokens"],))
                       if self.meta["num_tokens"] else np.zeros(0, dtype=self.meta["dtype"]))

    def __len__(self) -> int:
        return len(self.tokens)


def text_files(root: str | Path, pattern: str = "**/*", max_bytes: int | None = None) -> Iterable[str]:
    """Texts of the files under root matching pattern, in sorted order, up to max_bytes in all."""
    total = 0
    for path in sorted(Path(root).expanduser().glob(pattern)):
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable files are not text to train on
        yield text
        total += len(text.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            return


def stdlib_token_file(tokenizer, cache_dir: str | Path, max_bytes: int) -> TokenFile:
    """The default corpus: this Python's standard library sources, tokenized once and cached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    tag = f"stdlib-py{sysconfig.get_python_version()}-{max_bytes}-{_slug(tokenizer.name)}"
    path = Path(cache_dir).expanduser() / f"{tag}.bin"
    problem = token_file_problem(path) if path.with_suffix(".json").is_file() else None
    if problem:
        print(f"parallel3d: rebuilding {path}: {problem}", file=sys.stderr, flush=True)
    if problem or not path.with_suffix(".json").is_file():  # the first run waits for this: shown on rank 0
        done = f"tokenized the standard library into {path}"
        with Progress().counter("tokenizing the default corpus", "tok", done=done) as update:
            write_token_file(text_files(root, "*.py", max_bytes), tokenizer, path, progress=update)
    return TokenFile(path)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)[-40:]
