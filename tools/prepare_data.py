#!/usr/bin/env python
"""Build a token file for training from a folder of text files.

    python tools/prepare_data.py --input DIR --output corpus.bin [--pattern "**/*.txt"]
                                 [--tokenizer byte|path/to/tokenizer.json] [--max-bytes N]

Writes corpus.bin (token ids) and corpus.json (how to read them). Train on it with
    python -m parallel3d.train data=tokens data.path=corpus.bin data.tokenizer=<same tokenizer>
"""

from __future__ import annotations

import argparse
import sys
import time

from parallel3d.data import TokenFile, load_tokenizer, text_files, write_token_file
from parallel3d.progress import Progress


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="folder of text files")
    parser.add_argument("--output", required=True, help="token file to write (.bin)")
    parser.add_argument("--pattern", default="**/*", help="glob of files under --input (default: all)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a Hugging Face tokenizer.json")
    parser.add_argument("--max-bytes", type=int, default=None, help="stop after this much text")
    args = parser.parse_args(argv)

    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    # A bar on stderr when it is a terminal; the line below reports the result either way.
    with Progress(enabled=True).counter("tokenizing", "tok") as update:
        path = write_token_file(text_files(args.input, args.pattern, args.max_bytes), tokenizer, args.output, update)
    tokens = TokenFile(path)
    print(f"{path}: {len(tokens):,} tokens ({tokens.meta['dtype']}, tokenizer {tokenizer.name}) "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
