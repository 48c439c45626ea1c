"""Load chat datasets (hub, local JSON/JSONL/Parquet) and normalise their records.

Two record shapes are accepted: ShareGPT (`conversations` of `{from, value}`) and
OpenAI-style (`messages` of `{role, content}`). Normalised messages are `{role, content}`
with role in system/user/assistant. A record that cannot be used is skipped with a reason.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

# Well-known hub datasets by short name: (hub id, default split).
HUB_ALIASES = {
    "sharegpt": ("Aeala/ShareGPT_Vicuna_unfiltered", "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
    "ultrachat-200k": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
}

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


class BadRecord(ValueError):
    """A record that cannot be used; `reason` is the stats key, the message names the field."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class RawRecord:
    source: str  # file path or hub id
    index: int  # 0-based record index (JSONL: line number - 1)
    record_id: str
    data: dict | None  # None when the line was not valid JSON
    error: str = ""


def _record_id(data: dict, fallback: str) -> str:
    for key in ("id", "conversation_id", "prompt_id"):
        if isinstance(data.get(key), (str, int)):
            return str(data[key])
    return fallback


def iter_jsonl(path: Path) -> Iterator[RawRecord]:
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                yield RawRecord(str(path), index, f"line {index + 1}", None, f"invalid JSON: {e}")
                continue
            if not isinstance(data, dict):
                yield RawRecord(str(path), index, f"line {index + 1}", None, "not a JSON object")
                continue
            yield RawRecord(str(path), index, _record_id(data, f"line {index + 1}"), data)


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
            return
        import datasets

        builder = {".json": "json", ".parquet": "parquet"}.get(path.suffix)
        if builder is None:
            raise ValueError(f"{path}: unsupported dataset file type {path.suffix!r} (use .jsonl, .json or .parquet)")
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
        name = str(path)
    elif source == "hub":
        import datasets

        hub_id, default_split = HUB_ALIASES.get(spec["name"].lower(), (spec["name"], "train"))
        ds = datasets.load_dataset(
            hub_id, spec.get("subset"), split=spec.get("split") or default_split, revision=spec.get("revision")
        )
        name = hub_id
    else:
        raise ValueError(f"unknown dataset source {source!r}")
    for index, data in enumerate(ds):
        yield RawRecord(name, index, _record_id(data, f"record {index}"), data)


def normalise(record: dict, require_reply: bool = True) -> list[dict[str, str]]:
    """Return `[{role, content}, ...]` or raise BadRecord naming the field at fault.

    Training data needs an assistant turn; benchmark prompts (`require_reply=False`) do not."""
    if "messages" in record and record["messages"] is not None:
        turns, role_key, content_key, field = record["messages"], "role", "content", "messages"
    elif "conversations" in record and record["conversations"] is not None:
        turns, role_key, content_key, field = record["conversations"], "from", "value", "conversations"
    else:
        raise BadRecord("no_conversation", "has neither a 'messages' nor a 'conversations' field")
    if not isinstance(turns, list) or not turns:
        raise BadRecord("empty_conversation", f"field '{field}' is empty or not a list")
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
        if not isinstance(content, str):
            raise BadRecord("non_string_content", f"{where}.{content_key} is {type(content).__name__}, not a string")
        if not content.strip():
            raise BadRecord("empty_content", f"{where}.{content_key} is empty")
        messages.append({"role": role, "content": content})
    first_non_system = next((m for m in messages if m["role"] != "system"), None)
    if first_non_system is not None and first_non_system["role"] == "assistant":
        raise BadRecord("starts_with_assistant", f"{field}: the conversation starts with an assistant turn")
    if require_reply and not any(m["role"] == "assistant" for m in messages):
        raise BadRecord("no_assistant_turn", f"{field}: no assistant turn to train on")
    return messages
