"""Benchmark prompts: the opening of each conversation, up to (not including) the first reply.

Accepted sources:
- a JSONL path: our held-out file (`{"id", "task", "messages"}`), any OpenAI/ShareGPT-style
  records, or MT-bench-style questions (`{"question_id", "turns": [str, ...]}`, first turn used);
- a dataset spec dict as accepted by `draftsmith.data.chat_data.iter_records` (local or hub).
"""

from __future__ import annotations

import logging

from draftsmith.data.chat_data import BadRecord, RawRecord, iter_records, normalise

log = logging.getLogger(__name__)


def _prompt_messages(data: dict) -> list[dict[str, str]]:
    """System turns plus the first user turn of a record; raise BadRecord naming the field at fault."""
    if "turns" in data:
        turns = data["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise BadRecord("bad_turns", "field 'turns' must be a non-empty list starting with a non-empty string")
        return [{"role": "user", "content": turns[0]}]
    messages = normalise(data, require_reply=False)
    first_reply = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    messages = messages[:first_reply]
    if not messages or messages[-1]["role"] != "user":
        raise BadRecord("no_user_turn", "no user turn before the first assistant turn")
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: first_user + 1]


def _prompt_id(raw: RawRecord) -> str:
    data = raw.data or {}
    if isinstance(data.get("question_id"), (str, int)):
        return str(data["question_id"])
    return raw.record_id


def load_prompts(spec: str | dict, num_prompts: int) -> list[dict]:
    """The first `num_prompts` usable prompts of `spec` as `{"prompt_id", "messages"}` (ending with a user turn)."""
    if num_prompts < 1:
        raise ValueError(f"benchmark.num_prompts must be >= 1, got {num_prompts}")
    if isinstance(spec, dict):
        source_spec, name = spec, spec.get("path") or spec.get("name")
    else:
        source_spec, name = {"source": "local", "path": str(spec)}, str(spec)
    prompts: list[dict] = []
    seen: set[str] = set()
    for raw in iter_records(source_spec):
        where = f"{raw.source}: record {raw.index} (id {raw.record_id})"
        try:
            if raw.data is None:
                raise BadRecord("invalid_json", raw.error)
            messages = _prompt_messages(raw.data)
        except BadRecord as e:
            log.warning("skipping prompt %s: %s", where, e)
            continue
        prompt_id = _prompt_id(raw)
        if prompt_id in seen:
            raise ValueError(f"{where}: duplicate prompt id {prompt_id!r}; benchmark rows are keyed by prompt id")
        seen.add(prompt_id)
        prompts.append({"prompt_id": prompt_id, "messages": messages})
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no usable prompts in {name}")
    if len(prompts) < num_prompts:
        log.warning("%s has only %d usable prompts; benchmark.num_prompts asked for %d", name, len(prompts),
                    num_prompts)
    return prompts
