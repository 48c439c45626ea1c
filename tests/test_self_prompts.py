"""`source: self`: the target writes the user turns itself (Magpie-style), checked and counted, then answered by
regenerate like any other dataset (draftsmith/generation/self_prompts.py)."""

from __future__ import annotations

import logging

import pytest
import yaml
from conftest import jobs_planned, snakemake, write_config

from draftsmith.data import mtbench
from draftsmith.data.regenerated import read_regenerate_stats
from draftsmith.generation import prompt_filters as filters
from draftsmith.generation import self_prompts as sp
from draftsmith.generation.driver import regenerate
from draftsmith.generation.prompt_records import load_prompt_records
from draftsmith.io import read_jsonl

# ----------------------------------------------------------------------------- the template prefix


def test_the_prefix_is_the_template_up_to_a_user_turns_content(tiny_target):
    from chat_templates import CHATML_TOKENS, LLAMA3_TEMPLATE, LLAMA3_TOKENS, SMOLLM2_TEMPLATE, with_template
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    text, ids = sp.user_turn_prefix(tokenizer)
    assert text == "<|bos|><|user|>"
    assert ids == tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])[:len(ids)]

    # SmolLM2's template adds its default system turn before the first user turn: the prefix holds it
    text, ids = sp.user_turn_prefix(with_template(tokenizer, SMOLLM2_TEMPLATE, CHATML_TOKENS))
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\n")
    # Llama 3 trims the content and puts the bos token first
    llama = with_template(tokenizer, LLAMA3_TEMPLATE, LLAMA3_TOKENS)
    text, ids = sp.user_turn_prefix(llama)
    assert text == "<|bos|><|start_header_id|>user<|end_header_id|>\n\n"
    assert ids[0] == llama.bos_token_id and llama.decode(ids) == text


def test_a_tokenizer_without_a_chat_template_is_refused(tiny_target):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    tokenizer.chat_template = None
    with pytest.raises(sp.SelfPromptsError, match="has no chat template"):
        sp.user_turn_prefix(tokenizer)


# ----------------------------------------------------------------------------- the checks


@pytest.fixture(scope="module")
def mt_bench():
    return filters.BenchmarkOverlap.mt_bench()


def test_every_mt_bench_turn_both_turns_is_a_benchmark_prompt(mt_bench):
    questions = mtbench.load_questions()
    assert len(questions) == 80 and all(len(q["turns"]) == 2 for q in questions)
    assert len(mt_bench.prompts) == 160
    for q in questions:
        for turn in q["turns"]:
            assert mt_bench.match(turn) == turn
            assert mt_bench.match(f"  {turn.upper()}  ") == turn  # case and spacing aside


def test_benchmark_overlap_exact_lightly_edited_and_unrelated(mt_bench):
    q81, q101 = (next(q for q in mtbench.load_questions() if q["question_id"] == i) for i in (81, 101))
    first = q81["turns"][0]  # "Compose an engaging travel blog post about a recent trip to Hawaii, ..."
    assert mt_bench.match(first) == first
    # lightly edited: other words here and there, punctuation and case
    edited = first.replace("engaging", "exciting").replace("Hawaii", "Fiji").upper().replace(",", ";")
    assert edited != first and mt_bench.match(edited) == first
    # inside a longer request
    wrapped = f"Hello! I need some help please. {first} Thank you so much."
    assert mt_bench.match(wrapped) == first
    # a second turn, edited
    second = q101["turns"][1]  # "If the "second person" is changed to "last person" in the above question, ..."
    assert mt_bench.match(second.replace("above question", "question above")) == second
    # unrelated prompts are no benchmark prompt, even ones that share common words
    for prompt in ("Write a Python function that returns the n-th Fibonacci number.",
                   "What is the capital of Australia, and why was it chosen?",
                   "Can you make it shorter?",
                   "Compose a haiku about autumn leaves falling in the park.",
                   "I'm planning a trip next month; what should I pack for a week of hiking?"):
        score, _ = mt_bench.score(prompt)
        assert mt_bench.match(prompt) is None, (prompt, score)


def test_the_overlap_threshold_is_the_share_of_the_smaller_ngram_set():
    bench = filters.BenchmarkOverlap(["one two three four five six seven eight nine ten"], threshold=0.5)
    # 9 bigrams; a candidate sharing 5 of its 9 (more than half of the smaller set) overlaps, 4 of 9 does not
    assert bench.match("one two three four five six x y z w u v") is not None
    assert bench.match("one two three four five x y z w u v q") is None
    assert filters.BenchmarkOverlap(["one two three four five six seven eight nine ten"], threshold=0.9).match(
        "one two three four five six x y z w u v") is None
    with pytest.raises(ValueError, match="threshold"):
        filters.BenchmarkOverlap(["a b"], threshold=0)


def test_each_check_drops_and_counts_by_the_first_reason(mt_bench):
    checks = filters.PromptFilter(mt_bench, min_words=3, max_words=12)
    loop = [5, 6, 7] * 30  # is_repetitive: the last 64 tokens are one block repeated
    cases = [
        ("   \n", [1], "stop", "empty"),
        ("a b c " * 30, loop, "length", "repetitive"),
        ("How do I cook rice without a rice cooker", list(range(40)), "length", "cut_at_max_new_tokens"),
        ("Hi there", [1, 2], "stop", "too_short"),
        (" ".join(["word"] * 13), list(range(13)), "stop", "too_long"),
        (mtbench.load_questions()[0]["turns"][1], list(range(10)), "stop", "benchmark_overlap"),
        ("How do I cook rice without a rice cooker?", list(range(10)), "stop", None),
        ("how do I  cook rice without a rice cooker?", list(range(10)), "stop", "duplicate"),  # case, spacing aside
        ("How do I cook rice without a rice cooker!", list(range(10)), "stop", None),  # punctuation makes another
    ]
    got = [checks.reason(text, ids, finish) for text, ids, finish, _ in cases]
    assert got == [reason for *_, reason in cases]
    assert checks.dropped == {r: 1 for r in filters.FILTERS}
    with pytest.raises(ValueError, match="min_words"):
        filters.PromptFilter(mt_bench, min_words=5, max_words=4)


# ----------------------------------------------------------------------------- writing prompts with a real target


def write(target, out, num_prompts=3, **kwargs):
    settings = dict(max_new_tokens=12, min_words=1, max_candidates_factor=6, chunk_size=4, batch_size=2,
                    show_progress=False)
    return sp.self_prompts(target, out, num_prompts, **{**settings, **kwargs})


def test_the_target_writes_prompts_reproducibly_and_every_candidate_is_counted(tiny_target, tmp_path):
    stats = write(tiny_target, tmp_path / "a.jsonl")
    rows = read_jsonl(tmp_path / "a.jsonl")
    assert len(rows) == stats["prompts"] == stats["num_prompts"] == 3 and not stats["bound_reached"]
    assert all(r["messages"][0]["role"] == "user" and r["messages"][0]["content"].strip() for r in rows)
    assert all(list(r) == ["id", "messages"] and len(r["messages"]) == 1 for r in rows)
    indices = [int(r["id"].removeprefix("self_")) for r in rows]
    assert indices == sorted(indices)
    # every candidate sampled is a prompt, dropped by one reason, or beyond what was needed
    assert stats["candidates"] == stats["prompts"] + sum(stats["dropped_by_reason"].values()) + stats["beyond_num_prompts"]
    assert stats["dropped"] == sum(stats["dropped_by_reason"].values())
    assert set(stats["dropped_by_reason"]) <= set(filters.FILTERS)
    assert stats["candidates"] <= stats["max_candidates"] == 18
    assert stats["template_prefix"] == "<|bos|><|user|>"
    assert read_regenerate_stats(tmp_path / "a.jsonl", "self_prompts") == stats
    assert not (tmp_path / "a.jsonl.chunks").exists()

    # the same settings write the same file, however the work is chunked and batched
    again = write(tiny_target, tmp_path / "b.jsonl", chunk_size=1, batch_size=3)
    assert read_jsonl(tmp_path / "b.jsonl") == rows and again["fingerprint"] == stats["fingerprint"]
    # another seed, or another dataset name, writes other prompts
    other_seed = write(tiny_target, tmp_path / "c.jsonl", seed=1)
    other_name = write(tiny_target, tmp_path / "d.jsonl", name="other")
    assert read_jsonl(tmp_path / "c.jsonl") != rows and read_jsonl(tmp_path / "d.jsonl") != rows
    assert len({stats["fingerprint"], other_seed["fingerprint"], other_name["fingerprint"]}) == 3


def test_an_interrupted_run_keeps_its_finished_chunks(tiny_target, tmp_path, monkeypatch, caplog):
    from draftsmith.generation.hf_backend import HFBackend

    real, calls = HFBackend.generate, []

    def killed_at_second_chunk(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(self, *a, **k)

    out = tmp_path / "p.jsonl"
    monkeypatch.setattr(HFBackend, "generate", killed_at_second_chunk)
    with pytest.raises(RuntimeError, match="interrupted"):
        write(tiny_target, out, num_prompts=4, chunk_size=2)
    assert not out.exists() and len(list((tmp_path / "p.jsonl.chunks").glob("candidates_*.jsonl"))) == 1
    monkeypatch.setattr(HFBackend, "generate", real)
    resumed = write(tiny_target, out, num_prompts=4, chunk_size=2)
    assert resumed["chunks_reused"] == 1
    fresh = write(tiny_target, tmp_path / "fresh.jsonl", num_prompts=4, chunk_size=2)
    assert read_jsonl(out) == read_jsonl(tmp_path / "fresh.jsonl") and fresh["chunks_reused"] == 0

    # chunks of other inputs (here another temperature) are discarded, saying what changed
    monkeypatch.setattr(HFBackend, "generate", killed_at_second_chunk)
    calls.clear()
    with pytest.raises(RuntimeError, match="interrupted"):
        write(tiny_target, out, num_prompts=4, chunk_size=2)
    monkeypatch.setattr(HFBackend, "generate", real)
    with caplog.at_level(logging.WARNING):
        changed = write(tiny_target, out, num_prompts=4, chunk_size=2, temperature=0.7)
    assert changed["chunks_reused"] == 0 and "changed: temperature" in caplog.text


def test_prompts_that_never_pass_stop_with_the_counts(tiny_target, tmp_path):
    # 4 tokens cannot hold 50 words: every candidate is too short (or cut, or empty)
    with pytest.raises(ValueError, match=r"none of the 6 prompts the target wrote passed the checks \(by reason: "):
        write(tiny_target, tmp_path / "none.jsonl", num_prompts=2, max_new_tokens=4, min_words=50,
              max_candidates_factor=3)
    assert not (tmp_path / "none.jsonl").exists()


@pytest.mark.parametrize("settings, message", [
    ({"temperature": 0.0}, "self_prompts.temperature must be above 0"),
    ({"min_words": 10, "max_words": 5}, "self_prompts.min_words (10) must be >= 1 and at most"),
    ({"max_candidates_factor": 0.5}, "self_prompts.max_candidates_factor must be >= 1"),
    ({"num_prompts": 0}, "num_prompts must be >= 1"),
])
def test_bad_settings_fail_before_any_model_loads(tiny_target, tmp_path, monkeypatch, settings, message):
    from draftsmith.target_model.spec import TargetSpec

    monkeypatch.setattr(TargetSpec, "load_tokenizer", lambda self: pytest.fail("the tokenizer was loaded"))
    num_prompts = settings.pop("num_prompts", 2)
    with pytest.raises(sp.SelfPromptsError) as e:
        write(tiny_target, tmp_path / "x.jsonl", num_prompts=num_prompts, **settings)
    assert message in str(e.value)


def test_regenerate_answers_them_and_the_counts_reach_the_report(tiny_target, tmp_path):
    from draftsmith.data.tokenization import prepare_dataset
    from draftsmith.report.load import load_stats
    from draftsmith.target_model.spec import TargetSpec

    prompts = tmp_path / "self" / "mine.jsonl"
    written = write(tiny_target, prompts, num_prompts=3)
    records = load_prompt_records({"source": "local", "path": str(prompts)})
    assert len(records) == 3 and not records.dropped
    answers = tmp_path / "regenerated" / "mine.jsonl"
    stats = regenerate(records, tiny_target, answers, max_new_tokens=6, show_progress=False,
                       extra_stats={"self_prompts": read_regenerate_stats(prompts, "self_prompts")})
    assert stats["self_prompts"] == written and stats["num_answers"] == 3
    prepare_dataset({"source": "local", "path": str(answers)}, TargetSpec(str(tiny_target)).load_tokenizer(), 128,
                    tmp_path / "prepared" / "samples.parquet", tmp_path / "prepared" / "stats.json", name="mine")
    row = load_stats([tmp_path / "prepared" / "stats.json"]).iloc[0]
    # records read: the candidates the target wrote; each is dropped (by a check, or not needed), skipped or kept
    assert row["records_read"] == written["candidates"]
    assert row["records_read"] == row["dropped_by_regenerate"] + row["records_skipped"] + row["records_kept"]
    assert {k.removeprefix("self_prompts: ") for k in row["dropped_by_regenerate_by_reason"]} <= {
        *filters.FILTERS, "beyond_num_prompts"}


# ----------------------------------------------------------------------------- config and workflow


SELF = {"mine": {"source": "self", "num_prompts": 2, "regenerate": True}}


@pytest.mark.parametrize("datasets, extra, line", [
    ({"mine": {"source": "selff", "num_prompts": 2, "regenerate": True}}, {},
     "datasets.mine.source: 'selff' is not one of ['synthetic', 'fastchat', 'arena_hard', 'ifeval', 'self', 'local', "
     "'hub']"),
    ({"mine": {"source": "self", "regenerate": True}}, {}, "datasets.mine.num_prompts: is required"),
    ({"mine": {"source": "self", "num_prompts": 2}}, {},
     "datasets.mine: source self holds prompts without replies; set regenerate: true (the target answers them)"),
    ({"mine": {"source": "self", "num_prompts": 0, "regenerate": True}}, {},
     "datasets.mine.num_prompts: 0 is less than the minimum of 1"),
    (SELF, {"self_prompts": {"temprature": 0.7}}, "self_prompts.temprature: unknown key; did you mean 'temperature'?"),
    (SELF, {"self_prompts": {"temperature": 0}}, "self_prompts.temperature: 0 is less than or equal to the minimum of 0"),
    (SELF, {"self_prompts": {"min_words": 50, "max_words": 10}},
     "self_prompts.min_words: 50 is above self_prompts.max_words (10)"),
])
def test_bad_self_datasets_name_the_file_and_the_key(tmp_path, datasets, extra, line):
    from draftsmith.config.workflow import ConfigError, load_config

    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"datasets": datasets, **extra}))
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value).splitlines() == [f"{path}: {line}"]


def test_a_self_dataset_validates_with_its_defaults(tmp_path):
    from draftsmith.config.workflow import load_config

    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"datasets": SELF}))
    config = load_config([path])
    assert config["self_prompts"] == sp.DEFAULTS and config["datasets"]["mine"]["num_prompts"] == 2


def test_the_workflow_plans_self_prompts_before_regenerate_and_refuses_an_unknown_source(tmp_path):
    write_config(tmp_path, {"datasets": {**SELF, "synthetic": {"source": "synthetic"}}})
    planned = jobs_planned(snakemake(tmp_path, "-n"))
    assert planned["self_prompts"] == 1 and planned["regenerate"] == 1 and planned["prepare_dataset"] == 2

    path = write_config(tmp_path, {"datasets": {"mine": {"source": "magpie", "num_prompts": 2, "regenerate": True}}})
    result = snakemake(tmp_path, "-n", check=False)
    assert result.returncode != 0
    assert f"{path}: datasets.mine.source: 'magpie' is not one of" in result.stdout + result.stderr
    assert "self_prompts" not in jobs_planned(result)
