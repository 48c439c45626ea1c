"""The prompts regenerate answers: read from any dataset, deduplicated, never a benchmark question, and every
prompt left out counted by reason.

Not every prompt read is answered; each one dropped is counted by reason in the stats, and one warning
gives the counts: a record without a usable prompt (an empty or whitespace-only turn is `empty_content`;
unreadable records have the reasons prepare_dataset uses), the same prompt as an earlier one
(`duplicate_prompt`, compared case-folded with whitespace collapsed: `prompt_text_key`), an MT-Bench
question (`mtbench_question`), prompts mostly in non-Latin scripts from a prompt set (`not_latin_script`),
prompts past `max_records` (`beyond_max_records`), prompts with no room for an answer within seq_length
(`prompt_too_long`) or within the vllm engine's max_model_len (`prompt_exceeds_max_model_len`). A repeated
prompt id is no reason: the record is answered under `id#2`, `id#3`, ... (`duplicate_record_ids`), as
prepare_dataset names repeated ids, so every answer names one prompt.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

log = logging.getLogger(__name__)


class PromptRecords(list):
    """Prompt records `{"id", "messages"}` to answer, in order, and what reading them dropped.

    `records_read`: records read from the raw data (for source fastchat, user turns); `dropped`: a Counter of
    the prompts read but not in the list, by reason; `duplicate_record_ids`: prompts whose id repeated an
    earlier prompt's (kept under `id#2`, `id#3`, ...). Every prompt read is either in the list or in `dropped`.
    `later_user_turns`: user turns after a record's first, which a prompt leaves out (the target answers the first).
    """

    def __init__(self, records=(), records_read: int | None = None, dropped=None, duplicate_record_ids: int = 0,
                 later_user_turns: int = 0):
        super().__init__(records)
        self.dropped = Counter({k: v for k, v in (dropped or {}).items() if v})
        self.records_read = len(self) + sum(self.dropped.values()) if records_read is None else records_read
        self.duplicate_record_ids = duplicate_record_ids
        self.later_user_turns = later_user_turns

    def keep(self, kept, reason: str) -> "PromptRecords":
        """A copy holding `kept` (some of these records, in order); the others are counted as dropped for `reason`."""
        kept = list(kept)
        out = PromptRecords(kept, self.records_read, self.dropped, self.duplicate_record_ids, self.later_user_turns)
        if len(self) > len(kept):
            out.dropped[reason] += len(self) - len(kept)
        return out

    def describe_drops(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) or "none"


def _unique_id(record_id: str, occurrence: int, used: set[str]) -> str:
    """`id` for the first record with that id, `id#N` for the N-th (bumped past ids already taken), as
    prepare_dataset names the samples of repeated ids."""
    n = occurrence
    unique = record_id if n == 1 else f"{record_id}#{n}"
    while unique in used:
        n += 1
        unique = f"{record_id}#{n}"
    return unique


def prompt_text_key(messages: list[dict]) -> tuple:
    """What makes two prompts the same for deduplication: every turn's role and content, the content
    case-folded with runs of whitespace collapsed to one space (punctuation, digits and symbols count, so
    "2+2?" and "2-2?" differ; a different system turn makes a different prompt)."""
    return tuple((m["role"], " ".join(m["content"].casefold().split())) for m in messages)


def _later_user_turns(data: dict) -> int:
    """User turns of a raw record after its first (a prompt is the first; the later ones are not answered)."""
    from draftsmith.data.chat_data import normalise

    try:
        turns = data["turns"] if "turns" in data else normalise(data, require_reply=False)
    except Exception:  # noqa: BLE001 - a record that yields a prompt but does not normalise has no later turns to count
        return 0
    users = [t for t in turns if isinstance(t, str) or t.get("role") == "user"]
    return max(0, len(users) - 1)


def _read_prompt_file(spec) -> tuple[list[tuple[str, dict]], int, Counter, int]:
    """(where, record) of each usable prompt of a JSONL path or dataset spec, the number of records read, the
    records skipped by reason (each logged, named by `line N` or `record N`), and the user turns left out after
    each prompt's first."""
    from draftsmith.data.prompts import iter_prompts

    entries, read, skipped, later = [], 0, Counter(), 0
    for raw, prompt in iter_prompts(spec):
        read += 1
        if isinstance(prompt, Exception):
            skipped[prompt.reason] += 1
            log.warning("regenerate: skipped %s: %s", raw.where, prompt)
            continue
        later += _later_user_turns(raw.data)
        entries.append((raw.where, {"id": prompt["prompt_id"], "messages": prompt["messages"]}))
    return entries, read, skipped, later


def _check_prompt_list(prompts) -> tuple[list[tuple[str, dict]], int, Counter, int]:
    """(where, record) of each record of a list whose prompt is not blank, the number read, blank ones by
    reason, duplicate ids already counted (a PromptRecords carries them). Malformed records raise."""
    entries, skipped = [], Counter()
    for i, rec in enumerate(prompts):
        msgs = rec.get("messages") if isinstance(rec, dict) else None
        rid = str(rec.get("id", rec.get("prompt_id", i))) if isinstance(rec, dict) else str(i)
        where = f"prompt record {i} (id {rid})"
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                            for m in msgs):
            raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
        if msgs[-1].get("role") != "user":
            raise ValueError(f"{where}: the last message must be a user turn")
        blank = next((j for j, m in enumerate(msgs) if not m["content"].strip()), None)
        if blank is not None:
            skipped["empty_content"] += 1
            log.warning("regenerate: skipped %s: messages[%d].content is empty", where, blank)
            continue
        entries.append((where, {"id": rid, "messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}))
    if isinstance(prompts, PromptRecords):
        return entries, prompts.records_read, prompts.dropped + skipped, prompts.duplicate_record_ids
    return entries, len(prompts), skipped, 0


def load_prompt_records(prompts) -> PromptRecords:
    """The prompts to answer as a PromptRecords (`[{"id", "messages"}]` plus what was dropped on the way),
    from a JSONL path or dataset spec (any format draftsmith.data.prompts reads) or a list of records (a
    PromptRecords keeps its counts).

    Each prompt is its system turns plus the first user turn (what draftsmith.data.prompts takes). Read in
    order, a record is
    - skipped, counted by reason, if it has no usable prompt (an empty or whitespace-only turn: `empty_content`;
      the reasons of draftsmith.data.chat_data for a file; a malformed record of a list raises instead);
    - kept under `id#N` if its id repeats an earlier prompt's (`duplicate_record_ids`; prepare_dataset
      does the same with sample ids), so that every answer names one prompt;
    - dropped as `duplicate_prompt` if it is the same prompt as an earlier one (`prompt_text_key`: case and
      whitespace aside), which would be answered twice and could land in both training and validation.
    """
    later = carried = 0
    if isinstance(prompts, dict):
        entries, read, dropped, later = _read_prompt_file(prompts)
        duplicate_ids, name = 0, prompts.get("path") or prompts.get("name")
    elif isinstance(prompts, (str, Path)):
        entries, read, dropped, later = _read_prompt_file(prompts)
        duplicate_ids, name = 0, str(prompts)
    else:
        entries, read, dropped, duplicate_ids = _check_prompt_list(prompts)
        name = "the prompt list"
        # counted (and warned) where the list was read from its file
        carried = getattr(prompts, "later_user_turns", 0)
    if later:
        log.warning("regenerate: %d user turns after the first of their record are left out of %s (the target "
                    "answers each record's first user turn)", later, name)
    if not read:
        raise ValueError(f"no prompts in {name}")
    out, used, occurrences = [], set(), Counter()
    first_id: dict[str, str] = {}
    first_text: dict[tuple, str] = {}
    for where, rec in entries:
        rid = rec["id"]
        occurrences[rid] += 1
        if rid in first_id:
            duplicate_ids += 1
            rec = {**rec, "id": _unique_id(rid, occurrences[rid], used)}
            log.warning("regenerate: %s: duplicate prompt id %r (first seen at %s); kept, as %r", where, rid,
                        first_id[rid], rec["id"])
        else:
            first_id[rid] = where
            if rid in used:  # an earlier duplicate was renamed to this id
                rec = {**rec, "id": _unique_id(rid, 2, used)}
        used.add(rec["id"])
        key = prompt_text_key(rec["messages"])
        if key in first_text:
            dropped["duplicate_prompt"] += 1
            # one line per duplicate at debug level (FastChat repeats 946 turns); the warning gives the count
            log.debug("regenerate: dropped %s: the same prompt as %s (case and whitespace aside)", where,
                      first_text[key])
            continue
        first_text[key] = where
        out.append(rec)
    return PromptRecords(out, read, dropped, duplicate_ids, later or carried)


def regeneration_prompts(spec: dict, source: str, benchmark_questions: str | Path | None = None) -> PromptRecords:
    """The training prompts of a dataset (load_prompt_records' rules), never a benchmark prompt: any whose user
    turn equals (case, spacing and punctuation aside) an MT-Bench turn is dropped (`mtbench_question`), and the
    count logged.

    FastChat's conversations (source=fastchat) give every user turn (their 500 identity chats hold 1000, 54
    distinct: the rest are dropped as `duplicate_prompt`); the packaged prompt sets
    (draftsmith.data.prompt_sets) give their prompts (those mostly in non-Latin scripts dropped as
    `not_latin_script`); other sources give each record's first user turn. `max_records` counts the prompts
    kept; for fastchat and the prompt sets, those past it are counted as `beyond_max_records` (other sources
    stop reading there). `benchmark_questions`: MT-Bench's question.jsonl (default: the packaged one; the workflow
    passes the file it resolved, so that a job in another environment, e.g. envs/vllm.yaml, needs no data package).
    """
    from draftsmith.config.sources import PROMPT_SETS
    from draftsmith.data import mtbench, prompt_sets

    benchmark_turns = [t for q in mtbench.load_questions(benchmark_questions) for t in q["turns"]]
    limit = spec.get("max_records")
    if source == "fastchat":
        conversations = mtbench.load_conversations(spec["path"])
        turns = mtbench.training_prompts(conversations, dedupe=False)
        # training_prompts leaves out a turn without a word character ("", "?"): counted as empty_content
        read = sum(t["from"] in ("human", "user") for c in conversations for t in c["conversations"])
        records = load_prompt_records(PromptRecords(turns, read, {"empty_content": read - len(turns)}))
    elif source in PROMPT_SETS:
        skipped: Counter = Counter()
        rows = prompt_sets.load_prompt_set(source, spec["path"], skipped=skipped)
        records = load_prompt_records(PromptRecords([{"id": r["id"], "messages": r["messages"]} for r in rows],
                                                    dropped=skipped))
    else:
        records = load_prompt_records(spec)
    banned = {mtbench.normalise_text(t) for t in benchmark_turns}
    kept = records.keep([r for r in records if not any(
        m["role"] == "user" and mtbench.normalise_text(m["content"]) in banned for m in r["messages"])],
        "mtbench_question")
    if len(kept) < len(records):
        log.warning("regenerate: dropped %d prompts of %s that are MT-Bench questions (the benchmark prompts)",
                    len(records) - len(kept), spec.get("path") or spec.get("name"))
    return kept.keep(kept[:limit], "beyond_max_records") if limit else kept
