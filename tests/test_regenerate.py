"""Self-distillation: the target answers prompts in resumable chunks (on the tiny embedded target)."""

from __future__ import annotations

import json
import logging

import pytest

from draftsmith.generation import driver as regen
from draftsmith.generation.prompt_records import load_prompt_records, regeneration_prompts
from draftsmith.io import read_jsonl, write_jsonl

# questions like the synthetic tasks the tiny target was pretrained on, so that it answers them
QUESTIONS = ["What is 12 + 7?", "What is the capital of France?", "Count from 3 to 9.", "Say hi.",
             "Reverse the order of these words: apple river stone", "List the first 4 multiples of 3.",
             "Write this in capital letters: green table"]


def prompts(n=len(QUESTIONS)):
    return [{"id": f"p{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(QUESTIONS[:n])]


def rows(path):
    return read_jsonl(path)


def interrupt_at_second_chunk(monkeypatch):
    """regenerate's second chunk raises "interrupted", as a killed job would stop; returns the real chunk function."""
    real, calls = regen._generate_chunk, []

    def failing_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(*a, **k)

    monkeypatch.setattr(regen, "_generate_chunk", failing_second)
    return real


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
    # batch_size changes how the answers are computed, not what they are: the same fingerprint (finished chunks of one
    # are kept by the other), and the workflow does not re-run regenerate for it (rules/common.smk RUN_ONLY)
    assert one["fingerprint"] == many["fingerprint"]
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
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"):
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
    real = interrupt_at_second_chunk(monkeypatch)
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
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"), pytest.raises(RuntimeError):
        regen.regenerate(prompts(4), tiny_target, out, max_new_tokens=4, chunk_size=2, show_progress=False)
    assert "changed: prompts" in caplog.text


def test_the_hf_backend_on_a_gpu_says_in_its_fingerprint_that_it_compiles_the_layers(tiny_target, caplog):
    """On CUDA the engine compiles RMSNorm/MLP and, where Triton is installed, attends to each row's own
    slots (fused kernels round differently): a run moved between a CPU and a GPU, or to a GPU without Triton,
    re-answers rather than keeping answers the other path wrote. Without Triton it says why it cannot."""
    import torch

    from draftsmith.decoding.ragged_attention import ragged_attention_available
    from draftsmith.generation.hf_backend import HFBackend
    from draftsmith.target_model.spec import TargetSpec

    spec = TargetSpec(str(tiny_target))
    with caplog.at_level(logging.WARNING, logger="draftsmith.decoding.ragged_attention"):
        cpu, gpu = HFBackend(spec, {"device": "cpu"}), HFBackend(spec, {"device": "cuda:1"})
    assert not cpu.compile_layers and "compiled_layers" not in cpu.settings
    assert gpu.compile_layers and gpu.settings["compiled_layers"] == "RMSNorm, MLP"
    assert gpu.settings["decoder"] == cpu.settings["decoder"]
    assert not cpu.ragged and "attention" not in cpu.settings
    problem = ragged_attention_available(torch.device("cuda"))
    if problem is None:
        assert gpu.ragged and gpu.settings["attention"] == "ragged decode (Triton)"
    else:
        assert not gpu.ragged and "attention" not in gpu.settings
        assert f"not each row's own slots ({problem})" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draftsmith.decoding.ragged_attention"):
        sdpa = HFBackend(spec, {"device": "cuda:1", "attention": "sdpa"})  # asked for: no warning
    assert not sdpa.ragged and "attention" not in sdpa.settings and not caplog.text
    assert sdpa.settings == {k: v for k, v in gpu.settings.items() if k != "attention"}
    with pytest.raises(ValueError, match="regenerate.attention must be ragged or sdpa, got 'flash'"):
        HFBackend(spec, {"device": "cuda:1", "attention": "flash"})


def test_chunks_smaller_than_the_batch_are_named_with_the_chunk_size_that_fills_it(tiny_target, tmp_path, caplog):
    """Each chunk is one call of the backend: 2 prompts x 2 answers a chunk keep 4 of 8 rows busy; a warning says
    so and what fills them. A chunk as large as the batch, or a run of one chunk, gets no warning."""
    sampled = {"max_new_tokens": 4, "temperature": 0.8, "samples_per_prompt": 2, "show_progress": False}
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"):
        regen.regenerate(prompts(6), tiny_target, tmp_path / "small.jsonl", chunk_size=2, batch_size=8, **sampled)
    assert "a chunk of 2 prompts x 2 answers keeps at most 4 of the hf backend's 8 rows busy; " \
           "regenerate.chunk_size 4 or more fills them" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"):
        regen.regenerate(prompts(6), tiny_target, tmp_path / "filled.jsonl", chunk_size=4, batch_size=8, **sampled)
        regen.regenerate(prompts(3), tiny_target, tmp_path / "one.jsonl", chunk_size=3, batch_size=8, **sampled)
    assert "rows busy" not in caplog.text


def test_prompts_from_jsonl(tiny_target, tmp_path):
    from draftsmith.data import mtbench

    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, mtbench.as_prompt_records(mtbench.select_questions(mtbench.load_questions(), 1))[:3])
    records = load_prompt_records(path)
    assert [r["id"] for r in records] == [json.loads(line)["id"] for line in path.read_text().splitlines()]
    regen.regenerate(path, tiny_target, tmp_path / "out.jsonl", max_new_tokens=3, show_progress=False)
    assert len(rows(tmp_path / "out.jsonl")) == 3


@pytest.mark.parametrize("bad, message", [
    ([{"id": "a", "messages": []}], "record 0 \\(id a\\): field 'messages'"),
    ([{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}],
     "last message must be a user turn"),
    ([], "no prompts"),
])
def test_bad_prompt_records(bad, message):
    with pytest.raises(ValueError, match=message):
        load_prompt_records(bad)


def test_prompts_with_no_room_for_an_answer_are_skipped(tiny_target, tmp_path, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    records = prompts(3) + [{"id": "long", "messages": [{"role": "user", "content": "Tell me a story. " * 40}]}]
    lengths = [len(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)) for r in records]
    limit = max(lengths[:3]) + 1
    assert lengths[3] >= limit
    out = tmp_path / "answers.jsonl"
    with caplog.at_level(logging.INFO, logger="draftsmith.generation"):
        stats = regen.regenerate(records, tiny_target, out, max_new_tokens=4, show_progress=False,
                                 max_prompt_tokens=limit)
    assert [r["id"] for r in rows(out)] == ["p0", "p1", "p2"] and stats["num_prompts"] == 3
    assert stats["dropped_by_reason"] == {"prompt_too_long": 1} and stats["records_read"] == 4
    assert f"skipped 1 of 4 prompts of {limit} tokens or more" in caplog.text
    with pytest.raises(ValueError, match="nothing to regenerate"):
        regen.regenerate(records[3:], tiny_target, tmp_path / "none.jsonl", max_new_tokens=4, show_progress=False,
                         max_prompt_tokens=limit)


# ----------------------------------------------------------------------------- what is dropped, and why


def numbered_questions(n):
    return [f"What is {i} + 7?" for i in range(n)]


def test_every_dropped_prompt_is_counted_by_reason_through_prepare_into_the_report(tiny_target, tmp_path, caplog):
    """A 40-record file with an empty prompt, a whitespace-only one, an MT-Bench question and one too long for
    an answer: 4 dropped, each counted by reason in regenerate's stats file, carried by prepare into its
    stats.json, and shown by the report's data table as 40 read, 4 dropped by regenerate, 36 kept."""
    from transformers import AutoTokenizer

    from draftsmith.data import mtbench
    from draftsmith.data.tokenization import prepare_dataset
    from draftsmith.io import read_json
    from draftsmith.report.load import load_stats
    from draftsmith.report.tables import stats_table

    records = [{"id": f"q{i}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(numbered_questions(36))]
    records[5:5] = [{"id": "empty", "messages": [{"role": "user", "content": ""}]}]
    records[9:9] = [{"id": "blank", "messages": [{"role": "user", "content": " \n\t "}]}]
    records[20:20] = [{"id": "bench", "messages": [{"role": "user", "content": mtbench.load_questions()[0]["turns"][0]}]}]
    records.append({"id": "long", "messages": [{"role": "user", "content": "Tell me a story. " * 40}]})
    raw = tmp_path / "raw.jsonl"
    write_jsonl(raw, records)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    limit = 1 + max(len(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)) for r in records[:-1])
    out = tmp_path / "regenerated" / "chat.jsonl"
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"):
        returned = regen.regenerate(regeneration_prompts({"source": "local", "path": str(raw)}, "local"),
                                    tiny_target, out, max_new_tokens=2, batch_size=12, chunk_size=12,
                                    show_progress=False, max_prompt_tokens=limit)
    written = read_json(tmp_path / "regenerated" / "chat.stats.json")
    assert written == returned
    assert written["records_read"] == 40 and written["num_prompts"] == 36 == len(rows(out))
    assert written["prompts_dropped"] == 4
    assert written["dropped_by_reason"] == {"empty_content": 2, "mtbench_question": 1, "prompt_too_long": 1}
    assert "4 of 40 prompts read are not answered (empty_content: 2, mtbench_question: 1, prompt_too_long: 1)" \
        in caplog.text
    # each skipped record is named by its line (1-based), not its 0-based index
    assert f"skipped {raw}: line 6 (id empty): messages[0].content is empty" in caplog.text
    assert f"skipped {raw}: line 10 (id blank)" in caplog.text

    prepared = tmp_path / "prepared" / "chat"
    prepare_dataset({"source": "local", "path": str(out)}, tokenizer, 64, prepared / "samples.parquet",
                    prepared / "stats.json", name="chat")
    stats = read_json(prepared / "stats.json")
    assert stats["records_read"] == 36 and stats["regenerate"]["dropped_by_reason"] == written["dropped_by_reason"]
    df = load_stats([prepared / "stats.json"])
    row = stats_table(df).iloc[0]
    assert row["records read"] == 40 and row["dropped by regenerate"] == 4
    assert row["dropped by regenerate by reason"] == "empty_content: 2, mtbench_question: 1, prompt_too_long: 1"
    assert row["records read"] == row["dropped by regenerate"] + row["records skipped"] + row["records kept"]

    # stats of another version of the file are not carried over
    write_jsonl(out, rows(out)[:-1])
    with caplog.at_level(logging.WARNING):
        prepare_dataset({"source": "local", "path": str(out)}, tokenizer, 64, prepared / "samples.parquet",
                        prepared / "stats.json", name="chat")
    assert "regenerate" not in read_json(prepared / "stats.json") and "sha256 differs" in caplog.text


def test_the_same_prompt_under_another_id_is_answered_once(tiny_target, tmp_path, monkeypatch):
    """Duplicates compare case-folded with whitespace collapsed; punctuation and other turns still count. The
    fingerprint covers the prompts as answered, so a duplicate added to the input keeps finished chunks."""
    texts = ["Say hi.", "  say   HI. ", "What is 2+2?", "What is 2-2?", "What is 2+2?\n"]
    records = [{"id": f"d{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(texts)]
    records.append({"id": "sys", "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Say hi."}]})
    loaded = load_prompt_records(records)
    assert [r["id"] for r in loaded] == ["d0", "d2", "d3", "sys"]
    assert loaded.dropped == {"duplicate_prompt": 2} and loaded.records_read == 6

    out = tmp_path / "a.jsonl"
    stats = regen.regenerate(records, tiny_target, out, max_new_tokens=2, chunk_size=2, show_progress=False)
    assert [r["id"] for r in rows(out)] == ["d0", "d2", "d3", "sys"]
    assert stats["duplicate_prompts"] == 2 and stats["dropped_by_reason"] == {"duplicate_prompt": 2}
    unique = [r for r in records if r["id"] in ("d0", "d2", "d3", "sys")]
    assert regen.regenerate(unique, tiny_target, tmp_path / "b.jsonl", max_new_tokens=2, chunk_size=2,
                            show_progress=False)["fingerprint"] == stats["fingerprint"]

    real = interrupt_at_second_chunk(monkeypatch)
    with pytest.raises(RuntimeError):
        regen.regenerate(unique, tiny_target, tmp_path / "c.jsonl", max_new_tokens=2, chunk_size=2,
                         show_progress=False)
    monkeypatch.setattr(regen, "_generate_chunk", real)
    resumed = regen.regenerate(records, tiny_target, tmp_path / "c.jsonl", max_new_tokens=2, chunk_size=2,
                               show_progress=False)  # the duplicates added back: the same prompts are answered
    assert resumed["chunks_reused"] == 1 and rows(tmp_path / "c.jsonl") == rows(out)


def test_duplicate_ids_are_answered_under_unique_ids_and_prepare_keeps_them(tiny_target, tmp_path, caplog):
    """A file that prepare accepts with repeated ids is accepted by regenerate too: the second `x` is answered as
    `x#2` (an id `x#2` already in the file is bumped past), counted, and warned naming the lines."""
    from transformers import AutoTokenizer

    from draftsmith.data.tokenization import prepare_dataset, read_samples

    questions = numbered_questions(4)
    records = [{"id": "x", "messages": [{"role": "user", "content": questions[0]}]},
               {"id": "x", "messages": [{"role": "user", "content": questions[1]}]},
               {"id": "y", "messages": [{"role": "user", "content": questions[2]}]},
               {"id": "x#2", "messages": [{"role": "user", "content": questions[3]}]}]
    raw = tmp_path / "raw.jsonl"
    write_jsonl(raw, records)
    out = tmp_path / "chat.jsonl"
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"):
        stats = regen.regenerate(regeneration_prompts({"source": "local", "path": str(raw)}, "local"),
                                 tiny_target, out, max_new_tokens=2, show_progress=False)
    assert [r["id"] for r in rows(out)] == ["x", "x#2", "y", "x#2#2"]
    assert [r["messages"][0]["content"] for r in rows(out)] == questions
    assert stats["duplicate_record_ids"] == 1 and stats["prompts_dropped"] == 0 and stats["num_prompts"] == 4
    assert f"{raw}: line 2 (id x): duplicate prompt id 'x' (first seen at {raw}: line 1 (id x)); kept, as 'x#2'" \
        in caplog.text
    prepared = prepare_dataset({"source": "local", "path": str(out)}, AutoTokenizer.from_pretrained(tiny_target), 64,
                               tmp_path / "samples.parquet", tmp_path / "stats.json", name="chat")
    assert prepared["regenerate"]["duplicate_record_ids"] == 1
    kept = read_samples(tmp_path / "samples.parquet")["sample_id"]
    assert len(set(kept)) == len(kept) and set(kept) <= {"chat/x", "chat/x#2", "chat/y", "chat/x#2#2"}


def test_records_in_the_regenerate_path_are_named_by_line_or_record(tmp_path, caplog):
    """JSON Lines: `line <n>`, 1-based; JSON arrays (FastChat's conversations): `record <i>`, 0-based."""
    from draftsmith.data.mtbench import PromptDataError

    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "Say hi."}]}) + "\n\n"
                    + "{not json\n" + json.dumps({"id": "b", "messages": [{"role": "wizard", "content": "x"}]}) + "\n")
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"):
        records = regeneration_prompts({"source": "local", "path": str(path)}, "local")
    assert f"{path}: line 3: invalid JSON" in caplog.text and f"{path}: line 4 (id b): messages[0].role" in caplog.text
    assert "record 2" not in caplog.text and "record 3" not in caplog.text
    assert [r["id"] for r in records] == ["a"] and records.dropped == {"invalid_json": 1, "unknown_role": 1}

    conversations = tmp_path / "conversations.json"
    conversations.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},
                                         {"id": "b", "conversations": [{"from": "human"}]}]))
    with pytest.raises(PromptDataError, match=r"record 1 \(id b\): conversations\[0\] needs string fields"):
        regeneration_prompts({"path": str(conversations), "max_records": None}, "fastchat")


def test_fastchat_and_prompt_set_drops_are_counted(tmp_path):
    from draftsmith.data import mtbench

    fastchat = regeneration_prompts({"path": str(mtbench.fastchat_conversations_file()), "max_records": 50},
                                          "fastchat")
    assert len(fastchat) == 50 and fastchat.records_read == 1000  # 500 identity chats, two user turns each
    assert fastchat.dropped == {"duplicate_prompt": 946, "beyond_max_records": 4}
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"uid": "a", "subcategory": "math", "prompt": "Solve x + 1 = 2."},
        {"uid": "b", "subcategory": "math", "prompt": "Решите уравнение x + 1 = 2."},
        {"uid": "c", "subcategory": "math", "prompt": "solve  X + 1 = 2."}]))
    arena = regeneration_prompts({"path": str(path), "max_records": None}, "arena_hard")
    assert [r["id"] for r in arena] == ["arena_hard_a"] and arena.records_read == 3
    assert arena.dropped == {"not_latin_script": 1, "duplicate_prompt": 1}


# ----------------------------------------------------------------------------- seeds, samples, answer checks


def test_sampled_answers_depend_on_prompt_and_seed_not_on_chunks_or_batches(tiny_target, tmp_path):
    """Each sampled answer has its own seed (seed, prompt id, sample index): other chunk and batch sizes give the
    same file, and the fingerprint does not change, so finished chunks are kept across them."""
    sampling = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=3, show_progress=False)
    small = regen.regenerate(prompts(), tiny_target, tmp_path / "a.jsonl", batch_size=1, chunk_size=2, **sampling)
    large = regen.regenerate(prompts(), tiny_target, tmp_path / "b.jsonl", batch_size=7, chunk_size=7, **sampling)
    assert rows(tmp_path / "a.jsonl") == rows(tmp_path / "b.jsonl")
    assert small["fingerprint"] == large["fingerprint"]
    other = regen.regenerate(prompts(), tiny_target, tmp_path / "c.jsonl", batch_size=7, chunk_size=7,
                             **{**sampling, "seed": 4})
    assert other["fingerprint"] != small["fingerprint"]
    assert [r["messages"] for r in rows(tmp_path / "c.jsonl")] != [r["messages"] for r in rows(tmp_path / "a.jsonl")]
    # the sampler applies the temperature as transformers does: close to 0 it samples the greedy answers
    regen.regenerate(prompts(), tiny_target, tmp_path / "greedy.jsonl", batch_size=3, **{**sampling, "temperature": 0})
    regen.regenerate(prompts(), tiny_target, tmp_path / "cold.jsonl", batch_size=3, **{**sampling, "temperature": 1e-3})
    assert rows(tmp_path / "cold.jsonl") == rows(tmp_path / "greedy.jsonl")


def test_seeds_are_per_answer():
    seeds = {regen.sample_seed(0, f"p{i}", k) for i in range(50) for k in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2 ** 63 for s in seeds)
    assert regen.sample_seed(0, "p1", 0) == regen.sample_seed(0, "p1", 0) != regen.sample_seed(1, "p1", 0)


def test_several_samples_per_prompt_have_their_own_ids_and_repeats_are_dropped(tiny_target, tmp_path):
    """samples_per_prompt: 4 at a low temperature: rows `<id>/s<k>`, unique; an answer equal to an earlier answer to
    the same prompt is dropped and counted; prepare takes the file with every row as its own sample. (The tiny
    target's next-token distributions are flat: at 0.3 its four answers to a prompt all differ, at 0.05 most agree.)"""
    from transformers import AutoTokenizer

    from draftsmith.data.tokenization import prepare_dataset, read_samples

    out = tmp_path / "answers.jsonl"
    stats = regen.regenerate(prompts(), tiny_target, out, max_new_tokens=6, temperature=0.05, samples_per_prompt=4,
                             chunk_size=3, show_progress=False)
    got = rows(out)
    ids = [r["id"] for r in got]
    assert len(set(ids)) == len(ids)
    by_prompt: dict[str, list] = {}
    for r in got:
        prompt_id, sample = r["id"].rsplit("/s", 1)
        assert 0 <= int(sample) < 4
        by_prompt.setdefault(prompt_id, []).append(r["messages"][-1]["content"])
    assert sorted(by_prompt) == sorted(p["id"] for p in prompts())
    assert all(len(set(answers)) == len(answers) for answers in by_prompt.values())
    assert stats["samples_per_prompt"] == 4 and stats["num_answers"] == len(got)
    assert stats["duplicate_answers"] > 0, "a low temperature on the tiny target repeats answers"
    assert stats["num_answers"] + stats["duplicate_answers"] == 4 * len(prompts())
    prepare_dataset({"source": "local", "path": str(out)}, AutoTokenizer.from_pretrained(tiny_target), 64,
                    tmp_path / "samples.parquet", tmp_path / "stats.json", name="chat")
    assert sorted(read_samples(tmp_path / "samples.parquet")["sample_id"]) == sorted(
        f"chat/{r['id']}" for r in got if r["messages"][-1]["content"].strip())


def test_several_samples_at_temperature_zero_fail_before_any_model_loads(tiny_target, tmp_path, monkeypatch):
    from draftsmith.target_model.spec import TargetSpec

    monkeypatch.setattr(TargetSpec, "load_tokenizer", lambda self: pytest.fail("the tokenizer was loaded"))
    with pytest.raises(ValueError, match=r"^regenerate\.samples_per_prompt: 2 answers per prompt need sampling"):
        regen.regenerate(prompts(), tiny_target, tmp_path / "a.jsonl", samples_per_prompt=2, show_progress=False)


def test_the_workflow_refuses_several_samples_at_temperature_zero(tmp_path):
    from conftest import snakemake, write_config

    write_config(tmp_path, {"datasets": {"synthetic": {"source": "synthetic", "regenerate": True}},
                            "regenerate": {"samples_per_prompt": 3, "temperature": 0.0}})
    result = snakemake(tmp_path, "-n", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "regenerate.samples_per_prompt: 3 answers per prompt need sampling (with temperature 0 every answer is the " \
           "same); set regenerate.temperature above 0, or samples_per_prompt: 1" in output


@pytest.mark.parametrize("installed, says", [
    (None, "vLLM 0.16.0 is not installed for "),
    ("0.15.1", "vLLM 0.15.1 is installed for "),
])
def test_vllm_backend_without_vllm_0_16_fails_before_anything_loads(tiny_target, tmp_path, monkeypatch, installed,
                                                                     says):
    from draftsmith.target_model.spec import TargetSpec
    from draftsmith.vllm_stack import installed as installed_module

    monkeypatch.setattr(installed_module, "installed_version", lambda package: installed)
    for loader in ("load_tokenizer", "load_causal_lm", "load_text_config"):
        monkeypatch.setattr(TargetSpec, loader, lambda self, *a: pytest.fail("the target was loaded"))
    with pytest.raises(regen.RegenerateSetupError) as error:
        regen.regenerate(prompts(), tiny_target, tmp_path / "a.jsonl", backend="vllm", show_progress=False)
    message = str(error.value)
    assert message.startswith(f"regenerate.backend: vllm: {says}")
    assert "pip install -r envs/vllm.lock.txt" in message and "make install-engine" in message
    assert not (tmp_path / "a.jsonl.chunks").exists()


class ScriptedBackend:
    """A backend answering from a script, to test the driver alone: `limit` tokens per prompt at most."""

    name = "scripted"

    def __init__(self, answers, limit=None):
        self.answers, self.limit, self.requests, self.settings = answers, limit, [], {"limit": limit}

    def prompt_limit(self, lengths, max_new_tokens):
        return self.limit

    def generate(self, requests, gen, progress=None):
        self.requests += requests
        return [self.answers(r) for r in requests]

    def close(self):
        pass


def test_prompts_beyond_the_engines_max_model_len_are_skipped_and_counted(tiny_target, tmp_path, caplog):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    records = prompts(3) + [{"id": "long", "messages": [{"role": "user", "content": "Tell me a story. " * 20}]}]
    lengths = [len(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True)) for r in records]
    backend = ScriptedBackend(lambda r: {"token_ids": [5, 6], "finish_reason": "stop"}, limit=max(lengths[:3]) + 1)
    with caplog.at_level(logging.INFO, logger="draftsmith.generation"):
        stats = regen.regenerate(records, tiny_target, tmp_path / "a.jsonl", backend=backend, show_progress=False,
                                 max_prompt_tokens=1000)
    assert [r["id"] for r in rows(tmp_path / "a.jsonl")] == ["p0", "p1", "p2"]
    assert stats["dropped_by_reason"] == {"prompt_exceeds_max_model_len": 1} and stats["records_read"] == 4
    assert "no room for an answer within the scripted engine's max_model_len" in caplog.text
    # both backends get the same prompts: the chat template's token ids with the generation prompt
    assert [r["prompt_ids"] for r in backend.requests] == [
        tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True) for r in records[:3]]


def test_answers_are_checked_cut_lengths_and_loops(tiny_target, tmp_path, caplog):
    """Three answers of four cut at max_new_tokens (a warning: most are cut), one of them a loop; the stats give the
    share cut, the length percentiles and the share repetitive, and prepare carries them into the data table."""
    from draftsmith.data.tokenization import prepare_dataset
    from draftsmith.io import read_json
    from draftsmith.report.load import load_stats
    from draftsmith.report.tables import display, stats_table
    from transformers import AutoTokenizer

    loop, prose = [40, 41, 42] * 30, list(range(100, 190))
    scripted = {"p0": {"token_ids": loop[:80], "finish_reason": "length"},
                "p1": {"token_ids": prose[:80], "finish_reason": "length"},
                "p2": {"token_ids": prose[:80], "finish_reason": "length"},
                "p3": {"token_ids": prose[:9], "finish_reason": "stop"}}
    records = prompts(4)
    by_ids = {tuple(AutoTokenizer.from_pretrained(tiny_target).apply_chat_template(
        r["messages"], add_generation_prompt=True)): scripted[r["id"]] for r in records}
    backend = ScriptedBackend(lambda request: by_ids[tuple(request["prompt_ids"])])
    out = tmp_path / "regenerated" / "chat.jsonl"
    with caplog.at_level(logging.WARNING, logger="draftsmith.generation"):
        stats = regen.regenerate(records, tiny_target, out, backend=backend, max_new_tokens=80, show_progress=False)
    assert "3 of 4 answers (75%) were cut at max_new_tokens=80" in caplog.text
    assert [r["repetitive"] for r in rows(out)] == [True, False, False, False]
    assert stats["cut_at_max_new_tokens"] == 3 and stats["cut_share"] == 0.75
    assert stats["new_tokens_percentiles"] == {"p10": 10, "p50": 80, "p90": 80}  # 9 tokens + the stop token
    assert stats["repetitive_answers"] == 1 and stats["repetitive_share"] == 0.25
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    prepare_dataset({"source": "local", "path": str(out)}, tokenizer, 256, tmp_path / "samples.parquet",
                    tmp_path / "prepared" / "stats.json", name="chat")
    assert read_json(tmp_path / "prepared" / "stats.json")["regenerate"]["cut_share"] == 0.75
    table = display(stats_table(load_stats([tmp_path / "prepared" / "stats.json"]))).iloc[0]
    assert table["cut at the token limit"] == "75.0% (3 of 4)" and table["loops"] == "25.0% (1 of 4)"


def test_repetition_check():
    from draftsmith.data.answer_checks import answer_stats, is_repetitive, nearest_rank

    assert is_repetitive([7] * 64) and is_repetitive(list(range(50)) + [1, 2, 3] * 30)
    sentence = list(range(200, 232))  # one 32-token sentence said twice at the end
    assert is_repetitive(list(range(10)) + sentence * 2)
    assert not is_repetitive(list(range(300, 333)) * 2)  # a 33-token block: too long to count
    assert not is_repetitive([7] * 63)  # shorter than the window
    assert not is_repetitive(list(range(64)) + [1, 2, 3])
    assert nearest_rank([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.1) == 1 and nearest_rank([5], 0.9) == 5
    assert answer_stats([])["cut_share"] is None


@pytest.mark.parametrize("settings, problem", [
    ({"backend": "vllm", "tensor_parallel_size": 2}, "gpus (regenerate): regenerate.tensor_parallel_size=2 but 0 GPU(s) "
                                                     "are visible"),
    ({"backend": "hf", "device": "cuda"}, "gpus (regenerate): regenerate.device='cuda' but no CUDA GPU is visible"),
])
def test_regenerate_gpus_this_machine_cannot_give_stop_the_run_before_any_job(tmp_path, settings, problem):
    from conftest import snakemake, write_config

    write_config(tmp_path, {"datasets": {"synthetic": {"source": "synthetic", "regenerate": True}},
                            "regenerate": settings})
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0 and problem in proc.stdout + proc.stderr and "No job was started." in proc.stdout + proc.stderr
    assert not [p for p in (tmp_path / "results").rglob("*") if p.is_file() and p.name != ".draftsmith.lock"]
