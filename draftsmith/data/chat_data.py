"""Load chat datasets (hub, local JSON/JSONL/Parquet) and normalise their records.

Two record shapes are accepted: ShareGPT (`conversations` of `{from, value}`) and
OpenAI-style (`messages` of `{role, content}`). Normalised messages are `{role, content}`
with role in system/user/assistant/tool (`developer` becomes system, `function` becomes
tool); OpenAI content-part lists are joined when every part is text; an assistant turn may
carry `tool_calls`, a tool turn `name` / `tool_call_id`. A record that cannot be used is
skipped with a reason.

Local files are read record by record with the standard `json` module, never through
`datasets` (whose JSON builder infers one Arrow type for all records and can silently
reshape or reject them):
- `.jsonl`, and `.json` files that do not start with `[`: JSON Lines. Each line is decoded
  on its own: a line that is not UTF-8 is skipped as `invalid_utf8`, a UTF-8 BOM at the
  start of the file is accepted, blank lines are ignored.
- `.json` files that start with `[`: one JSON array of records.
- `.parquet`: read with pyarrow; the file must have a `messages` or `conversations` column
  of list<struct>; each row is one record.
Positions are 1-based line numbers for line-based files (`line N`) and 0-based record
indexes for JSON arrays, Parquet and hub datasets (`record N`).
"""

from __future__ import annotations

import codecs
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

# Well-known hub datasets by short name: (hub id, default split).
HUB_ALIASES = {
    "sharegpt": ("Aeala/ShareGPT_Vicuna_unfiltered", "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
    "ultrachat-200k": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
}

ROLE_ALIASES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
}

# Content-part types whose text is kept (OpenAI chat completions and responses APIs).
TEXT_PART_TYPES = ("text", "input_text", "output_text")
CONVERSATION_COLUMNS = ("messages", "conversations")


class BadRecord(ValueError):
    """A record that cannot be used; `reason` is the stats key, the message names the field."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _parsed(source: str, index: int, data: Any, line: int | None) -> RawRecord:
    if not isinstance(data, dict):
        return _unreadable(source, index, "not_an_object", f"a JSON {_json_type(data)}, not a JSON object", line)
    return _record(source, index, data, line)


def iter_jsonl(path: Path) -> Iterator[RawRecord]:
    """JSON Lines, decoded line by line (a bad line costs that line only)."""
    source = str(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
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
    raw = path.read_bytes()
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
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
        raise ValueError(f"{path}: expected a JSON array of records, found a JSON {_json_type(records)}")
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


def _check_unicode(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord("invalid_unicode", f"{where} contains a lone surrogate (U+{ord(text[e.start]):04X}) at "
                        f"character {e.start}, which no tokenizer can encode") from None


def _content_text(content: Any, where: str) -> str:
    """A turn's content as text: a string, or an OpenAI list of content parts that are all text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRecord("non_string_content", f"{where} is {type(content).__name__}, not a string or a list of "
                        "text parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRecord("malformed_content_part", f"{where}[{j}] is not a content part with a 'type'")
        if part["type"] not in TEXT_PART_TYPES:
            raise BadRecord("non_text_content", f"{where}[{j}] is a {part['type']!r} part; only text can be "
                            "trained on, so the record is skipped")
        if not isinstance(part.get("text"), str):
            raise BadRecord("malformed_content_part", f"{where}[{j}].text is "
                            f"{type(part.get('text')).__name__}, not a string")
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(turn: dict, where: str) -> list[dict] | None:
    """An assistant turn's tool calls in the form chat templates expect (arguments as an object)."""
    calls = turn.get("tool_calls")
    if calls is None and isinstance(turn.get("function_call"), dict):  # OpenAI's legacy single call
        calls = [{"type": "function", "function": turn["function_call"]}]
        where = f"{where}.function_call"
    else:
        where = f"{where}.tool_calls"
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise BadRecord("malformed_tool_call", f"{where} is {type(calls).__name__}, not a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRecord("malformed_tool_call", f"{where}[{j}] has no function name")
        args = fn.get("arguments", {})
        if isinstance(args, str):  # OpenAI sends arguments as a JSON string; templates expect an object
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise BadRecord("malformed_tool_call", f"{where}[{j}].arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise BadRecord("malformed_tool_call", f"{where}[{j}].arguments is a JSON {_json_type(args)}, not an "
                            "object")
        _check_unicode(json.dumps(args, ensure_ascii=False) + fn["name"], f"{where}[{j}]")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def normalise(record: dict, require_reply: bool = True) -> list[dict]:
    """Return `[{role, content, ...}, ...]` or raise BadRecord naming the field at fault.

    Training data needs an assistant turn; benchmark prompts (`require_reply=False`) do not."""
    if "messages" in record and record["messages"] is not None:
        turns, role_key, content_key, field = record["messages"], "role", "content", "messages"
    elif "conversations" in record and record["conversations"] is not None:
        turns, role_key, content_key, field = record["conversations"], "from", "value", "conversations"
    else:
        raise BadRecord("no_conversation", "has neither a 'messages' nor a 'conversations' field")
    if not isinstance(turns, list):
        raise BadRecord("conversation_not_a_list", f"field '{field}' is a {type(turns).__name__}, not a list of turns")
    if not turns:
        raise BadRecord("empty_conversation", f"field '{field}' is an empty list")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise BadRecord("malformed_turn", f"{where} is not an object")
        raw_role = turn.get(role_key)
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise BadRecord("unknown_role", f"{where}.{role_key} = {raw_role!r} is not a known role")
        content = turn.get(content_key)
        tool_calls = _tool_calls(turn, where) if role == "assistant" else None
        if tool_calls is not None and content is None:
            content = ""  # a tool-calls-only reply: the calls are what the assistant says
        content = _content_text(content, f"{where}.{content_key}")
        _check_unicode(content, f"{where}.{content_key}")
        if not content.strip() and tool_calls is None and role != "tool":  # a tool may return nothing
            raise BadRecord("empty_content", f"{where}.{content_key} is empty")
        message: dict = {"role": role, "content": content}
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        if role == "tool":
            for key in ("name", "tool_call_id"):
                if isinstance(turn.get(key), str):
                    message[key] = turn[key]
        messages.append(message)
    first_non_system = next((m for m in messages if m["role"] != "system"), None)
    if first_non_system is not None and first_non_system["role"] == "assistant":
        raise BadRecord("starts_with_assistant", f"{field}: the conversation starts with an assistant turn")
    if require_reply and not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn", f"{field}: no assistant turn to train on")
    return messages


def record_tools(record: dict) -> list[dict] | None:
    """The record's tool definitions (OpenAI `tools`), passed to the chat template; BadRecord if malformed."""
    tools = record.get("tools")
    if tools is None or tools == []:
        return None
    if isinstance(tools, str):  # some exports store the definitions as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRecord("malformed_tools", f"field 'tools' is a string that is not valid JSON: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord("malformed_tools", "field 'tools' is not a list of tool definitions (objects)")
    return tools or None
