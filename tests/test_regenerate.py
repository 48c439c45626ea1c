"""Self-distillation: the target answers prompts in resumable chunks (on the tiny embedded target)."""

from __future__ import annotations

import json
import logging

import pytest

from draftsmith.data import regenerate as regen
from draftsmith.io import read_jsonl, write_jsonl

# questions like the synthetic tasks the tiny target was pretrained on, so that it answers them
QUESTIONS = ["What is 12 + 7?", "What is the capital of France?", "Count from 3 to 9.", "Say hi.",
             "Reverse the order of these words: apple river stone", "List the first 4 multiples of 3.",
             "Write this in capital letters: green table"]


def prompts(n=len(QUESTIONS)):
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS[:n])]


def rows(path):
    return read_jsonl(path)


def test_answers_every_prompt_in_order(tiny_target, tmp_path):
    out = tmp_path / "answers.jsonl"
    stats = regen.regenerate(prompts(), tiny_target, out, max_new_tokens=8, batch_size=3, chunk_size=3,
                             show_progress=False)
    got = rows(out)
    assert [r["id"] for r in got] == [p["id"] for p in prompts()]
    for r, p in zip(got, prompts()):
        assert r["messages"][:-1] == p["messages"]
        assert r["messages"][-1]["role"] == "assistant" and isinstance(r["messages"][-1]["content"], str)
        assert r["finish_reason"] in ("stop", "length") and 1 <= r["num_new_tokens"] <= 8
        assert r["finish_reason"] == "stop" or r["num_new_tokens"] == 8
    assert stats["num_prompts"] == 7 and stats["chunks"] == 3 and stats["chunks_reused"] == 0
    assert stats["new_tokens"] == sum(r["num_new_tokens"] for r in got)
    assert not (tmp_path / "answers.jsonl.chunks").exists()
    # the output is a chat dataset draftsmith can prepare: each record with an answer has a user turn and a reply;
    # an empty answer (the target ended its turn at once) is counted, and prepare skips it as empty_content
    from draftsmith.data.chat_data import BadRecord, normalise

    empty = [r for r in got if not r["messages"][-1]["content"].strip()]
    assert stats["empty_answers"] == len(empty) < len(got)
    assert all(normalise(r)[-1]["role"] == "assistant" for r in got if r not in empty)
    for r in empty:
        with pytest.raises(BadRecord, match="is empty"):
            normalise(r)


def test_left_padded_batches_answer_like_batch_size_one(tiny_target, tmp_path):
    one = regen.regenerate(prompts(), tiny_target, tmp_path / "b1.jsonl", max_new_tokens=12, batch_size=1,
                           chunk_size=7, show_progress=False)
    many = regen.regenerate(prompts(), tiny_target, tmp_path / "b7.jsonl", max_new_tokens=12, batch_size=7,
                            chunk_size=7, show_progress=False)
    assert one["fingerprint"] != many["fingerprint"]
    assert [r["messages"] for r in rows(tmp_path / "b1.jsonl")] == [r["messages"] for r in rows(tmp_path / "b7.jsonl")]


def test_resumes_finished_chunks_and_recomputes_on_mismatch(tiny_target, tmp_path, monkeypatch, caplog):
    out = tmp_path / "answers.jsonl"
    kwargs = dict(max_new_tokens=6, batch_size=2, chunk_size=2, show_progress=False)
    reference = tmp_path / "reference.jsonl"
    regen.regenerate(prompts(), tiny_target, reference, **kwargs)

    real, calls = regen._generate_chunk, []

    def failing_third(model, tokenizer, records, *a, **k):
        calls.append(records[0]["id"])
        if len(calls) == 3:
            raise RuntimeError("interrupted")
        return real(model, tokenizer, records, *a, **k)

    monkeypatch.setattr(regen, "_generate_chunk", failing_third)
    with pytest.raises(RuntimeError, match="interrupted"):
        regen.regenerate(prompts(), tiny_target, out, **kwargs)
    chunk_dir = tmp_path / "answers.jsonl.chunks"
    assert sorted(p.name for p in chunk_dir.glob("chunk_*.jsonl")) == ["chunk_00000.jsonl", "chunk_00001.jsonl"]
    assert not out.exists()

    calls.clear()
    monkeypatch.setattr(regen, "_generate_chunk", lambda *a, **k: (calls.append(a[2][0]["id"]), real(*a, **k))[1])
    stats = regen.regenerate(prompts(), tiny_target, out, **kwargs)
    assert calls == ["p4", "p6"] and stats["chunks_reused"] == 2
    assert rows(out) == rows(reference)

    # interrupted again, then rerun with another parameter: the old chunks are discarded, and it says why
    calls.clear()
    monkeypatch.setattr(regen, "_generate_chunk", failing_third)
    with pytest.raises(RuntimeError):
        regen.regenerate(prompts(), tiny_target, out, **kwargs)
    calls.clear()
    monkeypatch.setattr(regen, "_generate_chunk", lambda *a, **k: (calls.append(a[2][0]["id"]), real(*a, **k))[1])
    with caplog.at_level(logging.WARNING, logger="draftsmith.data.regenerate"):
        stats = regen.regenerate(prompts(), tiny_target, out, **{**kwargs, "max_new_tokens": 5})
    assert "changed: max_new_tokens" in caplog.text and "recomputing" in caplog.text
    assert calls == ["p0", "p2", "p4", "p6"] and stats["chunks_reused"] == 0
    assert all(r["num_new_tokens"] <= 5 for r in rows(out))


def test_prompts_with_unicode_line_separators_survive_the_chunks(tiny_target, tmp_path, monkeypatch):
    """Arena-Hard has prompts with U+2028 and form feeds: the chunk files keep them raw, and reading a chunk back
    (to finish, or to resume) must not split a row there (str.splitlines() did: JSONDecodeError on the H200)."""
    texts = ["first\u2028second", "a\x85b and \x0c c", "tab\there\r\nand crlf", "plain"]
    records = [{"id": f"s{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]
    out = tmp_path / "answers.jsonl"
    real, calls = regen._generate_chunk, []

    def failing_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(*a, **k)

    monkeypatch.setattr(regen, "_generate_chunk", failing_second)
    with pytest.raises(RuntimeError, match="interrupted"):
        regen.regenerate(records, tiny_target, out, max_new_tokens=3, chunk_size=2, show_progress=False)
    monkeypatch.setattr(regen, "_generate_chunk", real)
    stats = regen.regenerate(records, tiny_target, out, max_new_tokens=3, chunk_size=2, show_progress=False)
    assert stats["chunks_reused"] == 1
    assert [r["messages"][0]["content"] for r in rows(out)] == texts
    assert len(out.read_text(encoding="utf-8").split("\n")) == len(texts) + 1  # one row per line, raw separators kept


def test_changed_prompts_change_the_fingerprint(tiny_target, tmp_path, caplog, monkeypatch):
    out = tmp_path / "a.jsonl"
    chunk_dir = tmp_path / "a.jsonl.chunks"
    monkeypatch.setattr(regen, "_generate_chunk", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stop")))
    with pytest.raises(RuntimeError):
        regen.regenerate(prompts(3), tiny_target, out, max_new_tokens=4, chunk_size=2, show_progress=False)
    assert (chunk_dir / "manifest.json").is_file()
    with caplog.at_level(logging.WARNING, logger="draftsmith.data.regenerate"), pytest.raises(RuntimeError):
        regen.regenerate(prompts(4), tiny_target, out, max_new_tokens=4, chunk_size=2, show_progress=False)
    assert "changed: prompts" in caplog.text


def test_prompts_from_jsonl(tiny_target, tmp_path):
    from draftsmith.data import mtbench

    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, mtbench.as_prompt_records(mtbench.select_questions(mtbench.load_questions(), 1))[:3])
    records = regen.load_prompt_records(path)
    assert [r["id"] for r in records] == [json.loads(line)["id"] for line in path.read_text().splitlines()]
    regen.regenerate(path, tiny_target, tmp_path / "out.jsonl", max_new_tokens=3, show_progress=False)
    assert len(rows(tmp_path / "out.jsonl")) == 3


@pytest.mark.parametrize("bad, message", [
    ([{"id": "a", "messages": []}], "record 0 \\(id a\\): field 'messages'"),
    ([{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}],
     "last message must be a user turn"),
    ([{"id": "a", "messages": [{"role": "user", "content": "q"}]}] * 2, "duplicate id 'a'"),
    ([], "no prompts"),
])
def test_bad_prompt_records(bad, message):
    with pytest.raises(ValueError, match=message):
        regen.load_prompt_records(bad)


def test_prompts_with_no_room_for_an_answer_are_skipped(tiny_target, tmp_path, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    records = prompts(3) + [{"id": "long", "messages": [{"role": "user", "content": "Tell me a story. " * 40}]}]
    lengths = [len(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)) for r in records]
    limit = max(lengths[:3]) + 1
    assert lengths[3] >= limit
    out = tmp_path / "answers.jsonl"
    with caplog.at_level(logging.INFO, logger="draftsmith.data.regenerate"):
        stats = regen.regenerate(records, tiny_target, out, max_new_tokens=4, show_progress=False,
                                 max_prompt_tokens=limit)
    assert [r["id"] for r in rows(out)] == ["p0", "p1", "p2"] and stats["num_prompts"] == 3
    assert f"skipped 1 of 4 prompts of {limit} tokens or more" in caplog.text
    with pytest.raises(ValueError, match="nothing to regenerate"):
        regen.regenerate(records[3:], tiny_target, tmp_path / "none.jsonl", max_new_tokens=4, show_progress=False,
                         max_prompt_tokens=limit)
