"""Read chat datasets (hub, local JSON/JSONL/Parquet) record by record, as `RawRecord`s.

Local files are read with the standard `json` module, never through `datasets` (whose JSON
builder infers one Arrow type for all records and can silently reshape or reject them):
- `.jsonl`, and `.json` files that do not start with `[`: JSON Lines. Each line is decoded
  on its own: a line that is not UTF-8 is skipped as `invalid_utf8`, a UTF-8 BOM at the
  start of the file is accepted, blank lines are ignored.
- `.json` files that start with `[`: one JSON array of records.
- `.parquet`: read with pyarrow; the file must have a `messages` or `conversations` column
  of list<struct>; each row is one record.
Positions are 1-based line numbers for line-based files (`line N`) and 0-based record
indexes for JSON arrays, Parquet and hub datasets (`record N`). What a record says is
`draftsmith.data.chat_data`'s concern.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

# Well-known hub datasets by short name: (hub id, default split).
HUB_ALIASES = {
    "sharegpt": ("Aeala/ShareGPT_Vicuna_unfiltered", "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
    "ultrachat-200k": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
}

CONVERSATION_COLUMNS = ("messages", "conversations")


@dataclass
class RawRecord:
    source: str  # file path or hub id
    index: int  # 0-based record index (line-based files: line number - 1)
    record_id: str  # the record's own id, else a fallback naming its position
    data: dict | None  # None when the record could not be read; then `reason` and `error` say why
    error: str = ""
    reason: str = ""  # stats key when data is None: invalid_utf8, invalid_json, not_an_object
    line: int | None = None  # 1-based line number for line-based files
    has_own_id: bool = False  # record_id came from the record (id / conversation_id / prompt_id)

    @property
    def where(self) -> str:
        """`<file>: line N (id X)` or `<file>: record N (id X)`, for logs."""
        position = f"line {self.line}" if self.line is not None else f"record {self.index}"
        return f"{self.source}: {position}" + (f" (id {self.record_id})" if self.has_own_id else "")


def _own_record_id(data: dict) -> str | None:
    for key in ("id", "conversation_id", "prompt_id"):
        value = data.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            return str(value)
    return None


def _record(source: str, index: int, data: dict, line: int | None) -> RawRecord:
    own = _own_record_id(data)
    fallback = f"line {line}" if line is not None else f"record {index}"
    return RawRecord(source, index, own if own is not None else fallback, data, line=line, has_own_id=own is not None)


def _unreadable(source: str, index: int, reason: str, error: str, line: int | None) -> RawRecord:
    fallback = f"line {line}" if line is not None else f"record {index}"
    return RawRecord(source, index, fallback, None, error, reason, line)


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages: array, string, number, ..."""
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _parsed(source: str, index: int, data: Any, line: int | None) -> RawRecord:
    if not isinstance(data, dict):
        return _unreadable(source, index, "not_an_object", f"a JSON {json_type(data)}, not a JSON object", line)
    return _record(source, index, data, line)


def iter_jsonl(path: Path) -> Iterator[RawRecord]:
    """JSON Lines, decoded line by line (a bad line costs that line only)."""
    source = str(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                error = f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)"
                yield _unreadable(source, lineno - 1, "invalid_utf8", error, lineno)
                continue
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                yield _unreadable(source, lineno - 1, "invalid_json", f"invalid JSON: {e}", lineno)
                continue
            yield _parsed(source, lineno - 1, data, lineno)


def _starts_with_array(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096)
        while head and not head.lstrip(codecs.BOM_UTF8 + b" \t\r\n"):
            head = f.read(4096)
    return head.lstrip(codecs.BOM_UTF8).lstrip(b" \t\r\n")[:1] == b"["


def iter_json_array(path: Path) -> Iterator[RawRecord]:
    """A JSON array of records: one document, so undecodable bytes or bad syntax fail the whole file."""
    raw = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: invalid UTF-8 at byte {e.start + 1} (line {line}); a JSON array file is one "
                         "document and cannot be read around it (fix the file, or write it as JSON Lines, where "
                         "a bad line is skipped and counted)") from None
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); a .json file that "
                         "starts with '[' is read as one JSON array of records") from None
    if not isinstance(records, list):  # starts with '[' but e.g. trailing data made it something else
        raise ValueError(f"{path}: expected a JSON array of records, found a JSON {json_type(records)}")
    for index, data in enumerate(records):
        yield _parsed(str(path), index, data, None)


def _check_parquet_schema(path: Path, schema) -> None:
    import pyarrow as pa

    present = [c for c in CONVERSATION_COLUMNS if c in schema.names]
    if not present:
        raise ValueError(f"{path}: no 'messages' or 'conversations' column (columns: {', '.join(schema.names)})")
    for column in present:
        t = schema.field(column).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
        if not (is_list and pa.types.is_struct(t.value_type)):
            raise ValueError(f"{path}: column '{column}' has type {t}; expected a list of structs "
                             "(turns with role/content or from/value)")


def iter_parquet(path: Path, batch_size: int = 256) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-Parquet files
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from None
    _check_parquet_schema(path, pf.schema_arrow)
    index = 0
    for batch in pf.iter_batches(batch_size=batch_size):
        for data in batch.to_pylist():
            yield _record(str(path), index, data, None)
            index += 1


def iter_records(spec: dict) -> Iterator[RawRecord]:
    """Yield raw records of a dataset spec (see config/schema/config.schema.yaml: datasets)."""
    source = spec["source"]
    limit = spec.get("max_records")
    count = 0
    for record in _iter_source(spec, source):
        if limit is not None and count >= limit:
            return
        count += 1
        yield record


def _iter_source(spec: dict, source: str) -> Iterator[RawRecord]:
    if source in ("local", "synthetic"):
        path = Path(spec["path"])
        if not path.exists():
            raise FileNotFoundError(f"dataset file not found: {path}")
        if path.suffix == ".jsonl":
            yield from iter_jsonl(path)
        elif path.suffix == ".json":
            yield from (iter_json_array(path) if _starts_with_array(path) else iter_jsonl(path))
        elif path.suffix == ".parquet":
            yield from iter_parquet(path)
        else:
            raise ValueError(f"{path}: unsupported dataset file type {path.suffix!r} (use .jsonl, .json or .parquet)")
    elif source == "hub":
        import datasets

        hub_id, default_split = HUB_ALIASES.get(spec["name"].lower(), (spec["name"], "train"))
        ds = datasets.load_dataset(
            hub_id, spec.get("subset"), split=spec.get("split") or default_split, revision=spec.get("revision")
        )
        for index, data in enumerate(ds):
            yield _record(hub_id, index, data, None)
    else:
        raise ValueError(f"unknown dataset source {source!r}")
