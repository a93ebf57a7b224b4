"""Where documents come from: the files a ``data.sources`` entry names, read with pyarrow/datasets.

A source is one entry of ``data.sources``: a ``.jsonl``/``.jsonl.gz``/``.json`` file, a
``.parquet`` file, a folder or glob of such files, a folder written by
``datasets.Dataset.save_to_disk``, or a folder of text files (each file one document). It
resolves to *shards*, the unit that is tokenized and cached: one per data file, one per arrow
file of a saved dataset, one for a whole text folder. Reading is pyarrow's (json, parquet) and
datasets' (arrow files); we only turn their failures into one line that names the file, the
line or row, and the fix.
"""

from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from parallel3d.base import ConfigError

JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
BATCH_ROWS = 4096


class DataError(ConfigError):
    """Input data that cannot be trained on: names the file, the line or row, and the fix."""

    def __init__(self, where: str, problem: str, fix: str):
        self.where, self.problem, self.fix = where, problem, fix
        super().__init__("data.sources", where, problem, fix)

    def __reduce__(self):  # raised in a prepare_data.py worker process, re-raised in its parent
        return DataError, (self.where, self.problem, self.fix)


@dataclass(frozen=True)
class Shard:
    """One unit of tokenization: ``kind`` is json, parquet, arrow (a saved dataset's file) or text."""

    kind: str
    path: Path  # the file; for text, the folder
    files: tuple[Path, ...]  # what its content key covers

    def fingerprint(self) -> list:
        """Names, sizes and modification times: changes when the content changes."""
        return [self.kind, *[(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in self.files]]


def is_token_file(source: str) -> bool:
    """A token file written by parallel3d-prepare-data (NAME.bin with NAME.json beside it): already
    tokenized, read as it is."""
    path = Path(source).expanduser()
    return path.suffix == ".bin" and path.is_file() and path.with_suffix(".json").is_file()


def _kind(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(JSON_SUFFIXES):
        return "json"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return None


def resolve(source: str) -> list[Shard]:
    """The shards of one ``data.sources`` entry, in sorted order; DataError if there are none."""
    path = Path(source).expanduser()
    if any(c in source for c in "*?["):
        matches = [Path(p) for p in sorted(glob.glob(str(path), recursive=True)) if Path(p).is_file()]
        shards = [Shard(_kind(p), p, (p,)) for p in matches if _kind(p)]
    elif path.is_file():
        if _kind(path) is None:
            raise DataError(source, "not a .jsonl, .jsonl.gz, .json or .parquet file",
                            "rename it, or list the folder holding it (a folder of text files)")
        shards = [Shard(_kind(path), path, (path,))]
    elif (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        state = json.loads((path / "state.json").read_text())
        files = [path / f["filename"] for f in state["_data_files"]]
        shards = [Shard("arrow", f, (f,)) for f in files]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        data_files = [p for p in files if _kind(p)]
        shards = ([Shard(_kind(p), p, (p,)) for p in data_files] if data_files
                  else [Shard("text", path, tuple(files))] if files else [])
    else:
        raise DataError(source, "no such file or folder", "check the path (relative paths start where you launch)")
    if not shards or all(f.stat().st_size == 0 for s in shards for f in s.files):
        raise DataError(source, "the source is empty", "point data.sources at files that hold documents")
    return shards


def source_name(source: str) -> str:
    """A short name for metrics: the file or folder name without its data suffix."""
    name = Path(source.rstrip("/")).name
    for suffix in (*JSON_SUFFIXES, *PARQUET_SUFFIXES, ".bin"):
        name = name.removesuffix(suffix)
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "source"


def documents(shard: Shard, text_field: str) -> Iterator[str]:
    """The shard's documents in order. DataError names the file and line/row of bad input."""
    if shard.kind == "text":
        from parallel3d.data.dataset import text_files  # today's folder reader: skips binary files

        yield from text_files(shard.path)
        return
    row = 0
    for column in _text_columns(shard, text_field):
        _check_column(shard, column, text_field, row)
        yield from column.to_pylist()
        row += len(column)


def _text_columns(shard: Shard, text_field: str):
    """The text column in batches (pyarrow arrays), whatever the file kind."""
    import pyarrow as pa

    try:
        if shard.kind == "parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(shard.path)
            _require_field(shard, parquet.schema_arrow.names, text_field)
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=[text_field]):
                yield batch.column(0)
        elif shard.kind == "arrow":
            from datasets import Dataset

            table = Dataset.from_file(str(shard.path)).data.table
            _require_field(shard, table.column_names, text_field)
            yield from table.column(text_field).chunks
        else:
            table = _read_json(shard)
            _require_field(shard, table.column_names, text_field)
            yield from table.column(text_field).chunks
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(str(shard.path), f"cannot be read ({str(e).splitlines()[0][:120]})",
                        "rewrite or remove this file (is it truncated or of another format?)") from None


def _read_json(shard: Shard):
    import pyarrow as pa
    import pyarrow.json as pj

    opener = gzip.open if shard.path.name.endswith(".gz") else open
    with opener(shard.path, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):  # one JSON array of records rather than JSON lines
        with opener(shard.path, "rt", encoding="utf-8") as f:
            return pa.Table.from_pylist(json.load(f))
    return pj.read_json(pa.input_stream(str(shard.path), compression="detect"))


def _require_field(shard: Shard, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise DataError(f"{shard.path} row 0", f"no '{text_field}' field (fields: {', '.join(names)[:80]})",
                        f"set data.text_field to the field that holds the text")


def _check_column(shard: Shard, column, text_field: str, first_row: int) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    where = "line" if shard.kind == "json" else "row"
    if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
        raise DataError(f"{shard.path} {where} {_line(shard, first_row)}", f"'{text_field}' holds {column.type}, "
                        "not text", f"set data.text_field to a text field")
    if column.null_count:
        row = first_row + pc.index(column.is_null(), True).as_py()
        raise DataError(f"{shard.path} {where} {_line(shard, row)}", f"a record without the '{text_field}' field",
                        f"add the text to that record or remove it")
    try:
        column.validate(full=True)  # pyarrow's json reader passes invalid UTF-8 through
    except pa.ArrowInvalid:
        row = first_row + next(i for i, s in enumerate(column.cast(pa.binary()).to_pylist()) if not _utf8(s))
        raise DataError(f"{shard.path} {where} {_line(shard, row)}", "undecodable bytes (not UTF-8)",
                        "re-encode the file as UTF-8") from None


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _line(shard: Shard, row: int) -> int:
    """1-based line of a JSON-lines record (blank lines hold no record); parquet/arrow rows count from 0."""
    if shard.kind != "json":
        return row
    opener = gzip.open if shard.path.name.endswith(".gz") else open
    with opener(shard.path, "rb") as f:
        seen = -1
        for number, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if seen == row:
                return number
    return row + 1
