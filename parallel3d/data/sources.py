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
from parallel3d.data.integrity import remembered_digest

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

    def fingerprint(self, memo_dir: Path) -> list:
        """The SHA-256 of each file's bytes (a text folder's files also by their names in it):
        changes whenever the content does, whatever happened to sizes and modification times."""
        names = [str(f.relative_to(self.path)) if self.kind == "text" else "" for f in self.files]
        return [self.kind, *[(n, remembered_digest(f, memo_dir)) for n, f in zip(names, self.files)]]


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
            table = _read_json(shard, text_field)
            yield from table.column(text_field).chunks
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(str(shard.path), f"cannot be read ({str(e).splitlines()[0][:120]})",
                        "rewrite or remove this file (is it truncated or of another format?)") from None


def _read_json(shard: Shard, text_field: str):
    """The text column of a JSON-lines file (pyarrow, parsing that field only), or of a JSON array."""
    import pyarrow as pa
    import pyarrow.json as pj

    with _open_json(shard.path, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):  # one JSON array of records rather than JSON lines
        return _read_json_array(shard, text_field)
    schema = pa.schema([(text_field, pa.string())])
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        try:
            return pj.read_json(pa.input_stream(str(shard.path), compression="detect"), parse_options=options)
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e):
                raise
            # A line longer than pyarrow's read block (1 MiB): read again in blocks that hold the longest.
            blocks = pj.ReadOptions(block_size=_longest_line(shard.path) + 1)
            return pj.read_json(pa.input_stream(str(shard.path), compression="detect"), read_options=blocks,
                                parse_options=options)
    except pa.ArrowInvalid as e:  # its "row N" counts within a read block: find the line ourselves
        line, problem, fix = _first_bad_line(shard, text_field)
        if line is None:
            raise DataError(str(shard.path), f"cannot be read ({_without_row(str(e))})",
                            "rewrite or remove this file (is it truncated or of another format?)") from None
        raise DataError(f"{shard.path} line {line}", problem, fix) from None


def _longest_line(path: Path) -> int:
    """The length in bytes of the longest line of a (possibly gzipped) text file, read in chunks."""
    longest = current = 0
    with _open_json(path, "rb") as f:
        while chunk := f.read(8 << 20):
            parts = chunk.split(b"\n")
            current += len(parts[0])
            if len(parts) > 1:
                longest = max(longest, current, *(len(x) for x in parts[1:-1]))
                current = len(parts[-1])
    return max(longest, current)


def _open_json(path: Path, mode: str):
    encoding = None if "b" in mode else "utf-8"
    return gzip.open(path, mode, encoding=encoding) if path.name.endswith(".gz") else open(path, mode, encoding=encoding)


def _without_row(message: str) -> str:
    return message.splitlines()[0].split(" in row ")[0][:120]


def _first_bad_line(shard: Shard, text_field: str) -> tuple[int | None, str, str]:
    """The 1-based line of the first record pyarrow cannot take, what is wrong with it, the fix."""
    with _open_json(shard.path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            problem = _record_problem(raw, text_field)
            if problem is not None:
                return number, *problem
    return None, "", ""


def _record_problem(raw: bytes, text_field: str) -> tuple[str, str] | None:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "undecodable bytes (not UTF-8)", "re-encode the file as UTF-8"
    except ValueError as e:
        return f"not valid JSON ({str(e)[:80]})", "fix or remove that line (one JSON object per line)"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object", "make each line one JSON object"
    value = record.get(text_field)
    if value is not None and not isinstance(value, str):
        return (f"'{text_field}' holds {type(value).__name__}, not text",
                "set data.text_field to a text field, or fix that record")
    return None


def _read_json_array(shard: Shard, text_field: str):
    """A JSON array of records: one-line errors that name the line (bad JSON) or the array index."""
    import pyarrow as pa

    try:
        with _open_json(shard.path, "rt") as f:
            records = json.load(f)
    except UnicodeDecodeError:
        raise DataError(str(shard.path), "undecodable bytes (not UTF-8)", "re-encode the file as UTF-8") from None
    except json.JSONDecodeError as e:
        raise DataError(f"{shard.path} line {e.lineno} column {e.colno}", f"not valid JSON ({e.msg})",
                        "fix the file (a JSON array of records, or one JSON object per line)") from None
    if not isinstance(records, list):
        raise DataError(str(shard.path), f"a JSON {type(records).__name__}, not an array of records",
                        "write a JSON array of records, or one JSON object per line")
    texts = []
    for index, record in enumerate(records):
        value = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(value, str):
            problem = (f"a JSON {type(record).__name__}, not an object" if not isinstance(record, dict)
                       else f"a record without the '{text_field}' field" if value is None
                       else f"'{text_field}' holds {type(value).__name__}, not text")
            raise DataError(f"{shard.path} array index {index}", problem,
                            "fix that record, or set data.text_field to the field that holds the text")
        texts.append(value)
    return pa.table({text_field: pa.array(texts, pa.string())})


def _require_field(shard: Shard, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise DataError(f"{shard.path} row 0", f"no '{text_field}' field (fields: {', '.join(names)[:80]})",
                        missing_field_fix(names, data_format="text"))


_PROMPTS = ("prompt", "instruction", "question", "query", "input")
_RESPONSES = ("response", "output", "answer", "completion", "chosen")


def missing_field_fix(names: list[str], *, data_format: str) -> str:
    """The fix for records that lack the field ``data_format`` reads: the key that reads what
    they hold (chat or prompt/response records read as text, say), else the field keys."""
    prompt = next((n for n in _PROMPTS if n in names), None)
    response = next((n for n in _RESPONSES if n in names), None)
    if "messages" in names and data_format != "chat":
        return "these are chat records: set data.format=chat"
    if prompt and response and data_format != "prompt_response":
        return (f"these are prompt/response records: set data.format=prompt_response"
                + (f" data.prompt_field={prompt}" if prompt != "prompt" else "")
                + (f" data.response_field={response}" if response != "response" else ""))
    if data_format == "prompt_response":
        if prompt and response:
            return f"set data.prompt_field={prompt} data.response_field={response}"
        return "set data.prompt_field and data.response_field to the fields that hold the prompt and the response"
    if data_format == "chat":
        return "give each record a 'messages' list of {role, content}, or use data.format=prompt_response"
    return "set data.text_field to the field that holds the text"


def _check_column(shard: Shard, column, text_field: str, first_row: int) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc

    where = "line" if shard.kind == "json" else "row"
    if not pa.types.is_string(column.type) and not pa.types.is_large_string(column.type):
        raise DataError(f"{shard.path} {where} {_line(shard, first_row)}", f"'{text_field}' holds {column.type}, "
                        "not text", "set data.text_field to a text field")
    if column.null_count:
        row = first_row + pc.index(column.is_null(), True).as_py()
        raise DataError(f"{shard.path} {where} {_line(shard, row)}", f"a record without the '{text_field}' field",
                        "add the text to that record or remove it")
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
    with _open_json(shard.path, "rb") as f:
        seen = -1
        for number, line in enumerate(f, start=1):
            seen += bool(line.strip())
            if seen == row:
                return number
    return row + 1
