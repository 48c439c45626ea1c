"""The embedded (tiny) target is for tests and CPU smoke runs: the docs say what it cannot do, and build_target warns
when the config trains on none of the synthetic corpus it knows."""

from __future__ import annotations

import json

import yaml
from conftest import REPO, snakemake, write_config

from draftsmith.target_model.embedded import corpus_mismatch_warning


def test_the_warning_is_given_only_without_a_synthetic_dataset():
    assert corpus_mismatch_warning({"synthetic": {"source": "synthetic"}, "mine": {"source": "local"}}) is None
    warning = corpus_mismatch_warning({"mine": {"source": "local", "path": "x.jsonl"}, "chat": {"source": "hub"}})
    assert "no dataset here has source: synthetic (datasets: chat, mine)" in warning
    assert "cannot model your text" in warning and "says nothing about a real model" in warning


def test_config_docs_say_what_the_tiny_target_is_for_and_what_it_cannot_do():
    schema = yaml.safe_load((REPO / "config" / "schema" / "config.schema.yaml").read_text())["properties"]
    for description in (schema["target"]["properties"]["model"]["description"],
                        schema["embedded_target"]["description"]):
        assert "fast tests and CPU smoke runs of the whole DAG" in description
        assert "cannot model" in description and "nothing about a real model" in description
    docs = (REPO / "config" / "README.md").read_text()
    assert "cannot model your text" in docs and "cannot model a user's text" in docs


def test_build_target_warns_when_no_dataset_is_synthetic(tmp_path):
    """The tiny target is pretrained on the synthetic corpus even when the user lists only their own datasets;
    rule build_target says so on the console and in its log."""
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    write_config(tmp_path, {"datasets": {"mine": {"source": "local", "path": str(data)}},
                            "embedded_target": {"pretrain_steps": 1, "num_layers": 4, "vocab_size": 300},
                            "synthetic": {"num_records": 20, "num_heldout": 2}})
    proc = snakemake(tmp_path, str(tmp_path / "results" / "target"))
    expected = 'WARNING: target.model is "embedded": the tiny target is pretrained on the synthetic corpus only'
    assert expected in proc.stdout, proc.stdout[-3000:]
    assert "(datasets: mine)" in proc.stdout
    log = (tmp_path / "results" / "logs" / "build_target.log").read_text()
    assert "cannot model your text" in log
