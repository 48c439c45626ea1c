"""The report's offline-vs-vLLM section (benchmark.offline_reference): both backends' acceptance side by side, and the
prompts whose counters agree, computed from the two runs' own files."""

from __future__ import annotations

import pandas as pd
import pytest
from test_report import K, html_tables, make_inputs, workflow_config

from draftsmith.benchmark.results import write_results
from draftsmith.report.backends import backends_table
from draftsmith.report.build import build_report


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The report's inputs (variant `wide` benchmarked with vllm) and an offline reference of `wide` that agrees on
    every prompt but one, where it accepted one token less."""
    root = tmp_path_factory.mktemp("report_backends")
    paths = make_inputs(root)
    wide = root / "results" / "benchmark" / "wide"
    rows = pd.read_csv(wide / "per_prompt.csv").assign(backend="offline")
    rows = rows[["variant", "backend", "method", "prompt_id", "category", "prompt_tokens", "new_tokens", "target_forwards",
                 "drafts", "draft_tokens", "accepted_tokens", "seconds"] + [f"accept_pos_{i}" for i in range(1, K + 1)]]
    records = rows.to_dict("records")
    changed = next(r for r in records if r["method"] == "eagle3_draft" and r["prompt_id"] == 3 and r["accepted_tokens"])
    changed["accepted_tokens"] -= 1
    meta = {"variant": "wide", "backend": "offline", "device": "cpu: test (2 cores)", "dtype": "float32"}
    write_results(records, K, wide / "offline" / "per_prompt.csv", wide / "offline" / "summary.json", meta,
                  {"eagle3_draft": {"lossless": True}})
    return root, paths, wide / "offline" / "summary.json"


def test_backends_table_counts_the_prompts_whose_counters_agree(inputs):
    _, paths, reference = inputs
    table = backends_table(paths["summaries"], [reference])
    assert list(table["variant"]) == ["wide"] and list(table["method"]) == ["eagle3_draft"]
    row = table.iloc[0]
    assert row["prompts with equal counters"] == "5 of 6" and row["_differ"] == [3]
    vllm = pd.read_csv(paths["per_prompt"][1])
    accepted = int(vllm.loc[vllm["method"] == "eagle3_draft", "accepted_tokens"].sum())
    assert row["accepted tokens (offline / vLLM)"] == [accepted - 1, accepted]
    assert row["lossless (offline / vLLM)"] == [True, True]


def test_report_shows_the_section_only_with_a_reference(inputs):
    root, paths, reference = inputs
    out = root / "with_reference"
    tables = build_report(**paths, config=workflow_config(root), out_html=out / "report.html", out_md=out / "report.md",
                          figures_dir=out / "figures", reference=[reference])
    html = html_tables(out / "report.html")
    shown = html["table-backends"]
    assert list(shown["prompts with equal counters"]) == ["5 of 6"] and "_differ" not in shown.columns
    assert str(reference) in set(html["table-inputs"]["file"])
    md = (out / "report.md").read_text()
    assert md.index("## Benchmark summary") < md.index("## Offline and vLLM acceptance side by side") \
        < md.index("## Training (final values)")
    assert "draft/accept counters equal on 5 of 6 prompts (**they differ on 3**)" in md
    assert "backends" in tables
    plain = root / "plain"
    build_report(**paths, config=workflow_config(root), out_html=plain / "report.html", out_md=plain / "report.md",
                 figures_dir=plain / "figures")
    assert "table-backends" not in html_tables(plain / "report.html")
