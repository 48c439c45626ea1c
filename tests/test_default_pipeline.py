"""The embedded default's path on the real model: SmolLM2-135M-Instruct answers its own training prompts
(regenerate), the draft trains on those answers, and the benchmark runs on MT-Bench by category.

Small settings (a few FastChat prompts, short answers, one MT-Bench question per category) keep it to a few
minutes on a 2-core CPU; the rules, scripts and data are the default's. The target directory is the one the
session's import made (tests/test_gguf_target.py checks that import); the rule that makes it is planned here.
"""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from conftest import snakemake, write_config

from draftsmith.data import mtbench
from draftsmith.io import read_json

pytestmark = pytest.mark.slow

SMALL_DEFAULT = {
    "target": {"model": "smollm2-135m-instruct"},
    "datasets": {"fastchat": {"source": "fastchat", "regenerate": True, "max_records": 12},
                 "ifeval": {"source": "ifeval", "regenerate": True, "max_records": 4}},
    "regenerate": {"max_new_tokens": 24, "batch_size": 6, "chunk_size": 6, "temperature": 0.0},
    "extraction": {"num_shards": 1, "aux_layer_ids": None},
    "vocab": {"draft_vocab_size": 512},
    "training": {"epochs": 1, "total_seq_length": 512, "ttt_steps": 2},
    "variants": {"default": {}, "broad": {"datasets": ["ifeval"]}},
    "benchmark": {"prompts": "mt_bench", "mt_bench": {"per_category": 1, "seed": 0}, "max_new_tokens": 8,
                  "num_speculative_tokens": 2, "methods": ["target_greedy", "eagle3_draft"]},
}


@pytest.fixture(scope="module")
def default_run(smollm2_target, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("default_pipeline")
    write_config(workdir, SMALL_DEFAULT)
    plan = snakemake(workdir, "-n")
    assert "import_target" in plan.stdout and "regenerate" in plan.stdout
    shutil.copytree(smollm2_target, workdir / "results" / "target")
    snakemake(workdir)
    return workdir / "results"


def test_regenerated_answers_are_the_targets_and_feed_the_samples(default_run):
    rows = [json.loads(line) for line in (default_run / "data" / "regenerated" / "fastchat.jsonl").open()]
    assert len(rows) == 12
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"].strip() for r in rows)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    assert sum(r["num_new_tokens"] for r in rows) > 12 * 4
    stats = read_json(default_run / "prepared" / "fastchat" / "stats.json")
    assert stats["records_kept"] == 12 and stats["assistant_tokens"] > 0
    dataset_replies = {t["value"] for c in mtbench.load_conversations() for t in c["conversations"] if t["from"] == "gpt"}
    assert not any(r["messages"][-1]["content"] in dataset_replies for r in rows)  # the target's words, not FastChat's


def test_no_benchmark_prompt_is_in_the_training_data(default_run):
    benchmark = [json.loads(line) for line in (default_run / "benchmark" / "prompts.jsonl").open()]
    asked = {mtbench.normalise_text(m["content"]) for p in benchmark for m in p["messages"] if m["role"] == "user"}
    assert len(asked) == 8
    for dataset in ("fastchat", "ifeval"):
        for line in (default_run / "data" / "regenerated" / f"{dataset}.jsonl").open():
            for m in json.loads(line)["messages"]:
                assert mtbench.normalise_text(m["content"]) not in asked


def test_a_variant_trains_on_the_datasets_it_names(default_run):
    ifeval = read_json(default_run / "prepared" / "ifeval" / "stats.json")
    broad = read_json(default_run / "draft" / "broad" / "training_data.json")
    everything = read_json(default_run / "draft" / "default" / "training_data.json")
    assert broad["datasets"] == ["ifeval"] and everything["datasets"] == ["fastchat", "ifeval"]
    assert broad["train_samples"] + broad["val_samples"] == ifeval["records_kept"] == 4
    assert everything["train_samples"] + everything["val_samples"] == 16
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in (default_run / "report" / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert ["broad", "ifeval"] in [row[:2] for row in rows] and ["default", "fastchat, ifeval"] in [row[:2] for row in rows]


def test_mt_bench_results_by_category_and_lossless(default_run):
    summary = read_json(default_run / "benchmark" / "default" / "summary.json")
    assert set(summary["methods"]) == {"target_greedy", "eagle3_draft"}
    draft = summary["methods"]["eagle3_draft"]
    assert draft["lossless"] is True and draft["prompts"] == 8
    assert sorted(draft["per_category"]) == sorted(mtbench.CATEGORIES)
    per_prompt = pd.read_csv(default_run / "benchmark" / "default" / "per_prompt.csv")
    for category, stats in draft["per_category"].items():
        rows = per_prompt[(per_prompt["method"] == "eagle3_draft") & (per_prompt["category"] == category)]
        assert stats["acceptance_length"] == pytest.approx(rows["new_tokens"].sum() / rows["target_forwards"].sum())
    report = (default_run / "report" / "report.md").read_text()
    assert "Acceptance length per prompt category" in report and "humanities" in report
    manifest = read_json(default_run / "shards" / "fastchat" / "shard_0" / "manifest.json")
    assert manifest["layer_ids"][:3] == [2, 15, 27]  # vLLM's default for 30 layers
