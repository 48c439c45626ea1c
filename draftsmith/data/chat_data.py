"""Normalise the records of chat datasets (read by `draftsmith.data.readers`) to messages.

Two record shapes are accepted: ShareGPT (`conversations` of `{from, value}`) and
OpenAI-style (`messages` of `{role, content}`). Normalised messages are `{role, content}`
with role in system/user/assistant/tool (`developer` becomes system, `function` becomes
tool); OpenAI content-part lists are joined when every part is text; an assistant turn may
carry `tool_calls`, a tool turn `name` / `tool_call_id`. A record that cannot be used is
skipped with a reason.
"""

from __future__ import annotations

import json
from typing import Any

from draftsmith.data.readers import json_type

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


class BadRecord(ValueError):
    """A record that cannot be used; `reason` is the stats key, the message names the field."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


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
            raise BadRecord("malformed_tool_call", f"{where}[{j}].arguments is a JSON {json_type(args)}, not an "
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
