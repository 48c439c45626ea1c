"""Benchmark prompts from the held-out split, MT-bench-style question files and dataset specs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from draftsmith.data.prompts import load_prompts
from draftsmith.data.synthetic import generate_corpus
from draftsmith.io import write_jsonl


def write_heldout(tmp_path: Path, num_records: int, num_heldout: int, seed: int) -> tuple[Path, list[dict]]:
    """A synthetic corpus's held-out records, written to heldout.jsonl: (that path, the records)."""
    _, heldout = generate_corpus(num_records, num_heldout, seed=seed)
    write_jsonl(tmp_path / "heldout.jsonl", heldout)
    return tmp_path / "heldout.jsonl", heldout


def test_heldout_prompts_are_system_plus_first_user_turn(tmp_path):
    path, heldout = write_heldout(tmp_path, 20, 30, seed=1)
    prompts = load_prompts(str(path), 25)
    assert [p["prompt_id"] for p in prompts] == [r["id"] for r in heldout[:25]]
    for prompt, record in zip(prompts, heldout):
        first_user = next(i for i, m in enumerate(record["messages"]) if m["role"] == "user")
        assert prompt["messages"] == record["messages"][: first_user + 1]
        assert prompt["messages"][-1]["role"] == "user"
        assert prompt["category"] == record["task"]  # the synthetic task family
    assert any(p["messages"][0]["role"] == "system" for p in prompts)  # system prompts are kept
    assert any(len(r["messages"]) > 2 + (r["messages"][0]["role"] == "system") for r in heldout[:25])  # multi-turn cut


def test_mt_bench_questions_use_the_first_turn(tmp_path):
    path = tmp_path / "question.jsonl"
    write_jsonl(path, [
        {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post.", "Rewrite it in rhymes."]},
        {"question_id": 82, "category": "writing", "turns": ["Draft an email."]},
    ])
    prompts = load_prompts({"source": "local", "path": str(path)}, 10)
    assert prompts == [
        {"prompt_id": "81", "category": "writing", "messages": [{"role": "user", "content": "Write a travel blog post."}]},
        {"prompt_id": "82", "category": "writing", "messages": [{"role": "user", "content": "Draft an email."}]},
    ]


def test_sharegpt_and_prompt_only_records_and_bad_ones_are_skipped_by_name(tmp_path, caplog):
    path = tmp_path / "mixed.jsonl"
    records = [
        {"id": "sg", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello"}]},
        {"id": "only-user",
         "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]},
        {"id": "bad-role", "messages": [{"role": "wizard", "content": "x"}]},
        {"id": "bad-turns", "turns": []},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n{not json\n")
    with caplog.at_level(logging.WARNING, logger="draftsmith.data.prompts"):
        prompts = load_prompts(str(path), 10)
    assert prompts == [
        {"prompt_id": "sg", "category": "all", "messages": [{"role": "user", "content": "Hi there"}]},
        {"prompt_id": "only-user", "category": "all", "messages": [{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "2+2?"}]},
    ]
    warnings = caplog.text
    assert "id bad-role" in warnings and "messages[0].role = 'wizard'" in warnings
    assert "id bad-turns" in warnings and "'turns'" in warnings
    assert "invalid JSON" in warnings and "only 2 usable prompts" in warnings


def test_num_prompts_limits_and_errors_name_the_problem(tmp_path):
    path, heldout = write_heldout(tmp_path, 5, 8, seed=2)
    assert len(load_prompts(str(path), 3)) == 3
    write_jsonl(tmp_path / "dup.jsonl", [heldout[0], heldout[0]])
    with pytest.raises(ValueError, match=r"dup.jsonl: line 2 .*duplicate prompt id .*\(first seen at .*dup.jsonl: line 1 "):
        load_prompts(str(tmp_path / "dup.jsonl"), 5)
    write_jsonl(tmp_path / "none.jsonl", [{"id": "x", "turns": [""]}])
    with pytest.raises(ValueError, match="no usable prompts in .*none.jsonl"):
        load_prompts(str(tmp_path / "none.jsonl"), 5)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompts(str(tmp_path / "missing.jsonl"), 5)
