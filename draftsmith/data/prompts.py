"""Benchmark prompts: the opening of each conversation, up to (not including) the first reply.

Accepted sources:
- a JSONL path: our held-out file (`{"id", "task", "messages"}`), any OpenAI/ShareGPT-style
  records, or MT-bench-style questions (`{"question_id", "turns": [str, ...]}`, first turn used);
- a dataset spec dict as accepted by `draftsmith.data.readers.iter_records` (local or hub).

A prompt is `{"prompt_id", "category", "messages"}`, with an optional `follow_up` (MT-Bench's second
turn, asked after the target's own answer to `messages`; `benchmark.mt_bench.turns: 2`). The category
is the record's `category` (MT-Bench) or `task` (the synthetic corpus), else "all"; results are
summarised per category.
`write_benchmark_prompts` writes the set a benchmark_prompts rule resolves, which every
benchmark job then reads (`read_benchmark_prompts`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

from draftsmith.data.chat_data import BadRecord, normalise
from draftsmith.data.readers import RawRecord, iter_records
from draftsmith.io import iter_jsonl, write_jsonl

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


def _category(data: dict) -> str:
    for key in ("category", "task"):
        if isinstance(data.get(key), str) and data[key].strip():
            return data[key]
    return "all"


def iter_prompts(spec: str | Path | dict) -> Iterator[tuple[RawRecord, dict | BadRecord]]:
    """Each record of `spec` (a path, or a dataset spec dict) with its prompt `{"prompt_id", "category",
    "messages"}`, or with the BadRecord saying why it has none (its `reason` is the stats key). Name a
    record by `raw.where`: `line N` (1-based) in JSON Lines, `record N` (0-based) in arrays and Parquet."""
    source_spec = spec if isinstance(spec, dict) else {"source": "local", "path": str(spec)}
    for raw in iter_records(source_spec):
        try:
            if raw.data is None:
                raise BadRecord(raw.reason or "invalid_json", raw.error)
            messages = _prompt_messages(raw.data)
        except BadRecord as e:
            yield raw, e
            continue
        yield raw, {"prompt_id": _prompt_id(raw), "category": _category(raw.data), "messages": messages}


def load_prompts(spec: str | dict, num_prompts: int | None) -> list[dict]:
    """The first `num_prompts` (None: all) usable prompts of `spec` as `{"prompt_id", "category", "messages"}`
    (ending with a user turn). Benchmark rows are keyed by prompt id, so a repeated id fails."""
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"benchmark.num_prompts must be >= 1, got {num_prompts}")
    name = (spec.get("path") or spec.get("name")) if isinstance(spec, dict) else str(spec)
    prompts: list[dict] = []
    first_seen: dict[str, str] = {}
    for raw, prompt in iter_prompts(spec):
        if isinstance(prompt, BadRecord):
            log.warning("skipping prompt %s: %s", raw.where, prompt)
            continue
        prompt_id = prompt["prompt_id"]
        if prompt_id in first_seen:
            raise ValueError(f"{raw.where}: duplicate prompt id {prompt_id!r} (first seen at {first_seen[prompt_id]}); "
                             "benchmark rows are keyed by prompt id")
        first_seen[prompt_id] = raw.where
        prompts.append(prompt)
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no usable prompts in {name}")
    if num_prompts is not None and len(prompts) < num_prompts:
        log.warning("%s has only %d usable prompts; benchmark.num_prompts asked for %d", name, len(prompts),
                    num_prompts)
    return prompts


def resolve_benchmark_prompts(spec: dict) -> list[dict]:
    """The prompt set a resolved `benchmark.prompts` spec names (rules/common.smk: benchmark_prompts_spec)."""
    if spec["source"] == "mt_bench":
        from draftsmith.data.mtbench import as_prompt_records, load_questions, select_questions

        questions = select_questions(load_questions(spec["path"]), spec["per_category"], spec["seed"])
        return [{"prompt_id": r.pop("id"), **r} for r in as_prompt_records(questions, spec.get("turns", 1))]
    source = spec["path"] if spec["source"] == "heldout" else {k: v for k, v in spec.items() if k != "num_prompts"}
    return load_prompts(source, spec["num_prompts"])


def write_benchmark_prompts(spec: dict, out_path: str | Path) -> list[dict]:
    prompts = resolve_benchmark_prompts(spec)
    write_jsonl(out_path, prompts)
    categories = sorted({p["category"] for p in prompts})
    log.info("%d benchmark prompts in %d categories (%s) -> %s", len(prompts), len(categories),
             ", ".join(categories), out_path)
    return prompts


def read_benchmark_prompts(path: str | Path) -> list[dict]:
    """The prompts a benchmark_prompts rule wrote (draftsmith's own format, checked per line)."""
    prompts = []
    for lineno, row in iter_jsonl(path):
        if not isinstance(row, dict) or not {"prompt_id", "category", "messages"} <= set(row):
            raise ValueError(f"{path}, line {lineno}: needs fields prompt_id, category and messages; rebuild it "
                             "with `snakemake --forcerun benchmark_prompts`")
        if not isinstance(row.get("follow_up", ""), str):
            raise ValueError(f"{path}, line {lineno}: field 'follow_up' must be a string (the next user turn)")
        prompts.append(row)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
