"""Small sources of every kind, written by the tests themselves (no hub, no network)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path


def documents(prefix: str, count: int, seed: int = 0) -> list[str]:
    """Distinct documents of varied length, some non-ASCII."""
    rng = random.Random(f"{prefix}{seed}")
    words = ["alpha", "beta", "gamma", "Grüße", "世界", "x²", "def", "return", "lorem", "ipsum", "\n"]
    return [f"{prefix} {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for i in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text", gz: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts))
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({field: texts, "n": list(range(len(texts)))}), path, row_group_size=7)
    return path


def write_saved_dataset(path: Path, texts: list[str], shards: int = 2) -> Path:
    from datasets import Dataset

    Dataset.from_dict({"text": texts}).save_to_disk(str(path), num_shards=shards)
    return path


def write_mixture(root: Path, scale: int = 1) -> list[str]:
    """Three sources: a folder of two jsonl files (one gzipped), a parquet file and a saved dataset."""
    write_jsonl(root / "web" / "part-0.jsonl", documents("web", 40 * scale, 0))
    write_jsonl(root / "web" / "part-1.jsonl.gz", documents("web", 40 * scale, 1), gz=True)
    write_parquet(root / "books.parquet", documents("book", 60 * scale))
    write_saved_dataset(root / "wiki", documents("wiki", 50 * scale))
    return [str(root / "web"), str(root / "books.parquet"), str(root / "wiki")]
