"""The report stage, built from inputs made by the pipeline's own code on a tiny target.

Datasets are tokenized by `prepare_dataset` (one with bad records, so skips are real), shards
are extracted by the HF backend, draft configs are speculators' own, benchmark tables go
through `bench_results.write_results`. Training metrics are written in the documented
metrics.csv format (TODO: switch to the lead's session-scoped `embedded_run` fixture once it
exists, so every input comes from a real pipeline run).
"""

from __future__ import annotations

import base64
import json
import logging
import random
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import yaml

from draftsmith.benchmark.results import accept_columns, write_results
from draftsmith.io import read_json, sha256_file, write_json, write_jsonl
from draftsmith.report.build import FIGURES, ReportInputError, build_report, fmt

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATASETS = ["extra", "synthetic"]
VARIANTS = {"default": {"draft_layers": 1, "backend": "offline", "data_fraction": 1.0},
            "wide": {"draft_layers": 2, "backend": "vllm", "data_fraction": 0.5}}
CATEGORIES = ["coding", "writing"]
K = 3
NUM_SHARDS = 2
TTT = 3


# ----------------------------------------------------------------------------- inputs


def simulate_prompt(rng: random.Random, method: str, accept_prob: float, max_new: int) -> dict:
    """Counts of one greedy (speculative) decode where each draft token is accepted with `accept_prob`."""
    row = {"method": method, "new_tokens": 0, "target_forwards": 0, "drafts": 0, "draft_tokens": 0,
           "accepted_tokens": 0, **{c: 0 for c in accept_columns(K)}}
    while row["new_tokens"] < max_new:
        row["target_forwards"] += 1
        accepted = 0
        if method != "target_greedy":
            row["drafts"] += 1
            row["draft_tokens"] += K
            while accepted < K and rng.random() < accept_prob:
                accepted += 1
                row[f"accept_pos_{accepted}"] += 1
        row["accepted_tokens"] += accepted
        row["new_tokens"] += accepted + 1
    draft_cost = 0.0 if method == "target_greedy" else 0.15 * K * row["drafts"] * 0.01
    row["seconds"] = row["target_forwards"] * 0.01 + draft_cost
    return row


def write_benchmark(out_dir: Path, variant: str, backend: str, seed: int) -> dict:
    methods = {"target_greedy": 0.0, "prompt_lookup": 0.3, "untrained_draft": 0.05, "eagle3_draft": 0.7 + 0.1 * seed}
    if backend == "vllm":  # vLLM's benchmark only compares target-only and the trained draft
        methods = {m: p for m, p in methods.items() if m in ("target_greedy", "eagle3_draft")}
    rng, jitter = random.Random(seed), random.Random(100 + seed)
    rows = []
    for prompt_id in range(6):
        prompt_tokens = rng.randint(10, 40)
        for method, p in methods.items():
            row = simulate_prompt(rng, method, p, 32)
            if backend == "offline":  # three timed runs, a few percent apart (vLLM's backend times one)
                row["repeat_seconds"] = [row["seconds"] * (1 + jitter.uniform(-0.03, 0.03)) for _ in range(3)]
            rows.append({"variant": variant, "backend": backend, "prompt_id": prompt_id,
                         "category": CATEGORIES[prompt_id % 2], "prompt_tokens": prompt_tokens, **row})
    meta = {"variant": variant, "backend": backend, "device": "cpu: test (2 cores)", "dtype": "float32",
            "max_new_tokens": 32, "num_prompts": 6, "versions": {"torch": "2.13.0", "vllm": "0.16.0"}}
    summary = write_results(rows, K, out_dir / "per_prompt.csv", out_dir / "summary.json", meta)
    if backend == "vllm":  # the vLLM backend checks outputs against target-only greedy
        summary["methods"]["eagle3_draft"]["lossless"] = True
    else:  # as the offline backend writes a bf16 run in which two outputs left the greedy one at near-ties
        gaps = {"1": 0.0, "4": 0.125}
        summary["methods"]["eagle3_draft"].update(lossless=False, mismatched_prompts=list(gaps), divergences={
            pid: {"position": 3, "greedy_token": 7, "emitted_token": 9, "logit_gap": gap} for pid, gap in gaps.items()})
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_metrics(path: Path, variant: str, seed: int) -> None:
    """Log records shaped like speculators' Trainer logs them, through draftsmith's real metrics.csv writer."""
    from draftsmith.training.metrics import MetricsCSV

    logger = logging.getLogger(f"test_report.metrics.{variant}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = MetricsCSV(path, variant, TTT, bar=None)
    logger.addHandler(handler)
    rng = random.Random(seed)
    step = 0
    try:
        for epoch in range(3):
            for _ in range(5):
                losses = [3.0 / (1 + 0.2 * step) + 0.3 * t + rng.random() * 0.05 for t in range(TTT)]
                full = [min(1.0, 0.05 * (step + 1) * 0.8 ** t) for t in range(TTT)]
                metrics = {"loss": sum(losses), **{f"loss_{t}": v for t, v in enumerate(losses)},
                           **{f"full_acc_{t}": v for t, v in enumerate(full)},
                           **{f"cond_acc_{t}": min(1.0, v * 1.1) for t, v in enumerate(full)}}
                logger.info({"train": metrics, "epoch": epoch, "lr": 1e-3}, extra={"step": step})
                step += 1
            val = {f"{k}_epoch": v + 0.1 if k.startswith("loss") else v for k, v in metrics.items()}
            logger.info({"val": val, "epoch": epoch}, extra={"step": step})
    finally:
        logger.removeHandler(handler)


def make_inputs(root: Path) -> dict:
    from draftsmith.data.synthetic import generate_corpus
    from draftsmith.data.tokenization import prepare_dataset
    from draftsmith.draft_model import build_draft_config
    from draftsmith.extraction.driver import extract
    from draftsmith.target_model.embedded import build_model, train_tokenizer
    from draftsmith.target_model.spec import TargetSpec
    from draftsmith.training.trainer import data_summary

    results = root / "results"
    train, _ = generate_corpus(48, 1, seed=0)
    target = root / "target"
    target.mkdir(parents=True)
    tokenizer = train_tokenizer([m["content"] for r in train for m in r["messages"]], 400, target)
    import torch

    torch.manual_seed(0)
    build_model(tokenizer, {"hidden_size": 32, "intermediate_size": 64, "num_layers": 4, "num_heads": 2,
                            "num_kv_heads": 1, "max_position_embeddings": 512}).save_pretrained(target)
    data = {
        "synthetic": train[:30],
        "extra": train[30:] + [{"id": "no-answer", "messages": [{"role": "user", "content": "hi"}]}],
    }
    for name, records in data.items():
        path = root / "data" / f"{name}.jsonl"
        write_jsonl(path, records)
        if name == "extra":
            with open(path, "a") as f:
                f.write("{not json\n")
        out = results / "prepared" / name
        prepare_dataset({"source": "local", "path": str(path)}, tokenizer, 96, out / "samples.parquet",
                        out / "stats.json", name=name)
        for shard in range(NUM_SHARDS):
            extract(out / "samples.parquet", shard, results / "shards" / name / f"shard_{shard}", TargetSpec(str(target)),
                    {"backend": "hf", "num_shards": NUM_SHARDS, "device": "cpu", "dtype": "float32", "writer_threads": 1,
                     "batch_tokens": 2048, "max_batch_size": 64,
                     "aux_layer_ids": [1, 2, 3]})  # vLLM's default repeats a layer at 4
    for seed, (variant, v) in enumerate(VARIANTS.items()):
        draft_dir = results / "draft" / variant
        build_draft_config(TargetSpec(str(target)), 256, v["draft_layers"], [1, 2, 3], K).save_pretrained(draft_dir)
        write_metrics(draft_dir / "metrics.csv", variant, seed)
        write_benchmark(results / "benchmark" / variant, variant, v["backend"], seed)
        manifests = [str(results / "shards" / d / f"shard_{k}" / "manifest.json") for d in DATASETS
                     for k in range(NUM_SHARDS)]
        write_json(draft_dir / "training_data.json", data_summary(manifests, {
            "val_fraction": 0.1, "seed": 0, "data_fraction": v["data_fraction"], "epochs": 2, "ttt_steps": TTT}))
    write_jsonl(results / "benchmark" / "prompts.jsonl",
                [{"prompt_id": i, "category": CATEGORIES[i % 2], "messages": [{"role": "user", "content": "hi"}]}
                 for i in range(6)])
    return {
        "summaries": [results / "benchmark" / v / "summary.json" for v in VARIANTS],
        "per_prompt": [results / "benchmark" / v / "per_prompt.csv" for v in VARIANTS],
        "metrics": [results / "draft" / v / "metrics.csv" for v in VARIANTS],
        "drafts": [results / "draft" / v / "config.json" for v in VARIANTS],
        "training_data": [results / "draft" / v / "training_data.json" for v in VARIANTS],
        "stats": [results / "prepared" / d / "stats.json" for d in DATASETS],
        "manifests": [results / "shards" / d / f"shard_{k}" / "manifest.json" for d in DATASETS
                      for k in range(NUM_SHARDS)],
    }


def workflow_config(root: Path) -> dict:
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["datasets"] = {"synthetic": {"source": "synthetic"},
                          "extra": {"source": "local", "path": str(root / "data" / "extra.jsonl")}}
    config["variants"] = {v: {"draft_layers": s["draft_layers"]} for v, s in VARIANTS.items()}
    config["extraction"]["num_shards"] = NUM_SHARDS
    return config


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_inputs")
    return root, make_inputs(root)


@pytest.fixture(scope="module")
def built(inputs):
    root, paths = inputs
    out = root / "out"
    tables = build_report(**paths, config=workflow_config(root), out_html=out / "report.html",
                          out_md=out / "report.md", figures_dir=out / "figures", out_csv=out / "learning_curve.csv")
    return out, tables, paths


# ----------------------------------------------------------------------------- HTML tables


class TableParser(HTMLParser):
    """Cell texts of every <table id=...>, as {id: [[header...], [row...], ...]}."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.current = None
        self.cell = None

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.current = self.tables.setdefault(dict(attrs).get("id", ""), [])
        elif tag == "tr" and self.current is not None:
            self.current.append([])
        elif tag in ("td", "th") and self.current is not None:
            self.cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.current[-1].append(self.cell.strip())
            self.cell = None
        elif tag == "table":
            self.current = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell += data


def short_sha(path) -> str:
    """How the report's tables show a file's sha256: a prefix, so that no table runs off the page."""
    return sha256_file(path)[:12] + "…"


def html_tables(path: Path) -> dict[str, pd.DataFrame]:
    parser = TableParser()
    parser.feed(path.read_text())
    return {key: pd.DataFrame(rows[1:], columns=rows[0]) for key, rows in parser.tables.items()}


# ----------------------------------------------------------------------------- tests


# the inputs measure one batch size per variant: nothing to plot under load
LEFT_OUT = {"speedup_by_batch_size": "one batch size measured per variant (1), so there is no curve to draw"}
DRAWN = [name for name in FIGURES if name not in LEFT_OUT]


def test_every_figure_is_a_png_embedded_in_html_and_linked_from_markdown(built):
    out, _, _ = built
    html = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    assert sorted(p.name for p in (out / "figures").iterdir()) == sorted(f"{n}.png" for n in DRAWN)
    for name, why in LEFT_OUT.items():  # no empty figure: a line saying why stands in its place
        line = f"Figure left out ({FIGURES[name]}): {why}"
        assert f"\n*{line}" in md and f"<p class='left-out' id='figure-{name}'>{line}" in html
        assert f"{name}.png" not in md + html
    for name in DRAWN:
        png = (out / "figures" / f"{name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 5000, name
        assert f"src='data:image/png;base64,{base64.b64encode(png).decode()}'" in html, name
        assert f"](figures/{name}.png)" in md, name
    # self-contained: nothing is fetched from elsewhere
    assert "http://" not in html and "https://" not in html and "<link" not in html and "<script" not in html


def test_benchmark_table_equals_summaries(built):
    out, tables, paths = built
    shown = html_tables(out / "report.html")["table-summary"]
    expected = []
    for path in paths["summaries"]:
        s = read_json(path)
        for method, m in s["methods"].items():
            expected.append((s["variant"], method, fmt(m["acceptance_length"]), fmt(m["per_position_acceptance"]),
                             fmt(m.get("tokens_per_drafted_round")), fmt(m["tokens_per_s"], 1), fmt(m["speedup"], 2),
                             fmt(m.get("lossless"))))
    got = list(shown[["variant", "method", "acceptance length", "per-position acceptance", "tokens per drafted round",
                      "tokens/s", "speedup", "lossless"]].itertuples(index=False, name=None))
    assert sorted(got) == sorted(expected)
    assert len(got) == 4 + 2  # offline: four methods; vllm: two
    raw = tables["summary"].set_index(["variant", "method"])
    wide = read_json(paths["summaries"][1])["methods"]["eagle3_draft"]
    assert raw.loc[("wide", "eagle3_draft"), "acceptance length"] == wide["acceptance_length"]
    assert raw.loc[("wide", "eagle3_draft"), "lossless"] is True


def test_category_table_is_acceptance_per_category_of_the_per_prompt_rows(built):
    out, tables, paths = built
    rows = pd.concat([pd.read_csv(p) for p in paths["per_prompt"]])
    table = tables["categories"].set_index("category")
    assert sorted(table.index) == CATEGORIES
    for category in CATEGORIES:
        draft = rows[(rows["category"] == category) & (rows["method"] == "eagle3_draft") & (rows["variant"] == "wide")]
        assert table.loc[category, "trained EAGLE-3 draft (wide)"] == pytest.approx(
            draft["new_tokens"].sum() / draft["target_forwards"].sum())
        assert table.loc[category, "prompts"] == 3
        summary = read_json(paths["summaries"][1])["methods"]["eagle3_draft"]["per_category"][category]
        assert summary["acceptance_length"] == pytest.approx(table.loc[category, "trained EAGLE-3 draft (wide)"])
    assert "prompt lookup (wide)" not in table  # the vllm variant did not run it
    shown = html_tables(out / "report.html")["table-categories"]
    assert list(shown["category"]) == CATEGORIES


def test_data_size_table_and_finding(built):
    out, tables, paths = built
    table = tables["data_size"].set_index("variant")
    for path in paths["training_data"]:
        data = read_json(path)
        variant = path.parent.name
        assert table.loc[variant, "train tokens"] == data["train_tokens"]
        assert table.loc[variant, "acceptance length"] == read_json(
            paths["summaries"][list(VARIANTS).index(variant)])["methods"]["eagle3_draft"]["acceptance_length"]
    assert table.loc["wide", "train samples"] < table.loc["default", "train samples"]
    assert "What the amount of training data buys" in (out / "report.md").read_text()


def test_learning_curve_table_and_csv_from_the_inputs(built):
    """One row per variant: validation's accuracies per TTT step (the last validation row of metrics.csv), the chain
    acceptance they predict for the benchmark's k, and the benchmark's acceptance and speedup; the same in the report's
    table (HTML) and in learning_curve.csv."""
    out, tables, paths = built
    curve = pd.read_csv(out / "learning_curve.csv")
    assert list(curve["variant"]) == list(tables["learning_curve"]["variant"])
    assert curve["train_tokens"].is_monotonic_increasing
    assert {"variant", "data_fraction", "train_tokens", "acceptance_length", "predicted_acceptance_length",
            "speedup", *(f"val_full_acc_{i}" for i in range(TTT))} <= set(curve.columns)
    shown = html_tables(out / "report.html")["table-data_size"].set_index("variant")
    for row in curve.to_dict("records"):
        variant = row["variant"]
        summary = read_json(paths["summaries"][list(VARIANTS).index(variant)])
        draft = summary["methods"]["eagle3_draft"]
        assert row["acceptance_length"] == pytest.approx(draft["acceptance_length"])
        assert row["tokens_per_drafted_round"] == pytest.approx(draft["tokens_per_drafted_round"])
        assert row["speedup"] == pytest.approx(draft["speedup"])
        assert row["num_speculative_tokens"] == summary["num_speculative_tokens"] == K
        data = read_json(paths["training_data"][list(VARIANTS).index(variant)])
        assert (row["train_tokens"], row["data_fraction"]) == (data["train_tokens"], VARIANTS[variant]["data_fraction"])
        metrics = pd.read_csv(paths["metrics"][list(VARIANTS).index(variant)])
        last_val = metrics[metrics["split"] == "val"].iloc[-1]
        accs = [float(last_val[f"full_acc_{i}"]) for i in range(TTT)]
        assert [row[f"val_full_acc_{i}"] for i in range(TTT)] == pytest.approx(accs)
        assert row["predicted_acceptance_length"] == pytest.approx(1 + sum(accs[:K]))
        # k = TTT here: the prediction is the one training wrote into metrics.csv
        assert row["predicted_acceptance_length"] == pytest.approx(last_val["predicted_acceptance_length"])
        assert shown.loc[variant, "predicted acceptance length"] == fmt(row["predicted_acceptance_length"])
        assert shown.loc[variant, "val full acc per TTT step"] == fmt(accs)
        assert shown.loc[variant, "speedup"] == fmt(row["speedup"], 2)


def test_variants_in_config_order_and_methods_from_the_summaries(inputs, tmp_path):
    """Variants in the config's order, not alphabetical, in the title, the verdicts, their grounds and every table; a
    method the benchmark adds (`hybrid` here, beside the others in a summary) appears in the tables and the verdict's
    comparisons under its own name, with nothing in the report changed for it."""
    root, paths = inputs
    default = read_json(paths["summaries"][0])
    default["methods"]["hybrid"] = {**default["methods"]["eagle3_draft"], "acceptance_length": 2.75}
    write_json(tmp_path / "default" / "summary.json", default)
    out = tmp_path / "out"
    tables = build_report(**{**paths, "summaries": [tmp_path / "default" / "summary.json", paths["summaries"][1]]},
                          config=workflow_config(root), out_html=out / "report.html", out_md=out / "report.md",
                          figures_dir=out / "figures", variant_order=["wide", "default"])
    for key in ("summary", "speed", "load", "training", "predicted"):
        assert list(dict.fromkeys(tables[key]["variant"])) == ["wide", "default"], key
    summary = tables["summary"]
    assert list(summary[summary["variant"] == "default"]["method"]) == [
        "target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft", "hybrid"]
    md = (out / "report.md").read_text()
    assert md.startswith("# draftsmith report: EAGLE-3 draft wide, default\n")
    verdicts = md.split("## Verdict\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert [v.split("`")[1] for v in verdicts] == ["wide", "default"]
    assert md.index("### `wide`: the grounds") < md.index("### `default`: the grounds")
    grounds = md.split("### `default`: the grounds", 1)[1].split("\n## ", 1)[0]
    untrained = fmt(default["methods"]["untrained_draft"]["acceptance_length"], 2)
    hybrid = "2.75 with hybrid (prompt lookup, else the draft)"  # a method's display name (report.methods.LABELS)
    assert f"{untrained} with untrained draft, {hybrid}." in grounds  # the acceptance line: every method
    assert hybrid in md.split("## What this means", 1)[1].split("\n## ", 1)[0]


def test_findings_are_computed_from_the_benchmark(built):
    out, _, paths = built
    md = (out / "report.md").read_text()
    default = read_json(paths["summaries"][0])["methods"]
    line = next(x for x in md.splitlines() if x.startswith("- `default`"))
    assert f"accepts {fmt(default['eagle3_draft']['acceptance_length'], 2)} tokens per target forward" in line
    assert f"vs {fmt(default['prompt_lookup']['acceptance_length'], 2)} with prompt lookup" in line
    assert f"ran at {fmt(default['eagle3_draft']['speedup'], 2)}× the speed of target-only greedy" in line
    assert f"{fmt(default['target_greedy']['tokens_per_s'], 1)} tokens/s on cpu: test (2 cores)" in line
    assert "differed from target-only greedy on 2 of 6 prompts" in line and "by at most 0.125;" in line
    wide_line = next(x for x in md.splitlines() if x.startswith("- `wide`"))
    assert "prompt lookup" not in wide_line and "matched target-only greedy on every prompt" in wide_line


def test_data_shard_and_draft_tables_equal_inputs(built):
    out, _, paths = built
    shown = html_tables(out / "report.html")
    data = shown["table-data"].set_index("dataset")
    for path in paths["stats"]:
        stats = read_json(path)
        row = data.loc[stats["dataset"]]
        for field in ("records_read", "records_kept", "records_skipped", "tokens", "assistant_tokens"):
            assert row[field.replace("_", " ")] == fmt(stats[field]), (stats["dataset"], field)
    extra = read_json(paths["stats"][0])
    assert extra["records_skipped"] == 2 and "invalid_json: 1" in data.loc["extra", "skipped by reason"]

    shards = shown["table-shards"]
    assert len(shards) == len(paths["manifests"])
    for path in paths["manifests"]:
        manifest = read_json(path)
        row = shards[shards["manifest sha256"] == short_sha(path)]  # a prefix: the full one is in the checksums
        assert len(row) == 1, path
        row = row.iloc[0]
        assert (row["dataset"], row["shard"]) == (path.parent.parent.name, fmt(manifest["shard"]))
        assert (row["samples"], row["tokens"]) == (fmt(manifest["num_samples"]), fmt(manifest["num_tokens"]))
        assert row["tokens/s"] == fmt(manifest["tokens_per_second"], 1) and row["device"] == manifest["device"]

    drafts = shown["table-drafts"].set_index("variant")
    for path in paths["drafts"]:
        cfg = read_json(path)
        row = drafts.loc[path.parent.name]
        assert row["draft layers"] == fmt(cfg["transformer_layer_config"]["num_hidden_layers"])
        assert row["draft vocab"] == fmt(cfg["draft_vocab_size"]) and row["config sha256"] == short_sha(path)


def prepared_stats(dataset, read, kept, skipped, regenerate=None) -> dict:
    stats = {"dataset": dataset, "records_read": read, "records_kept": kept, "records_skipped": sum(skipped.values()),
             "skipped_by_reason": skipped, "duplicate_record_ids": 0, "records_truncated": 0, "tokens": 30 * kept,
             "assistant_tokens": 10 * kept, "seq_length": 64}
    return {**stats, "regenerate": regenerate} if regenerate is not None else stats


def test_data_table_shows_what_regenerate_dropped(tmp_path):
    """A regenerated dataset of 40 raw records, 4 dropped by regenerate (by reason) and 36 answered, one answer
    empty: the data table shows 40 read, 4 dropped by regenerate by reason, 1 skipped, 35 kept (not "36 read"),
    and the findings count from the raw records; a dataset that was not regenerated shows no drops."""
    from draftsmith.report.figures import plot_data_stats
    from draftsmith.report.load import load_stats
    from draftsmith.report.tables import display, findings, stats_table

    dropped = {"duplicate_prompt": 1, "empty_content": 2, "prompt_too_long": 1}
    paths = [tmp_path / "chat" / "stats.json", tmp_path / "raw" / "stats.json"]
    write_json(paths[0], prepared_stats("chat", 36, 35, {"empty_content": 1}, {
        "records_read": 40, "prompts_dropped": 4, "dropped_by_reason": dropped, "duplicate_prompts": 1,
        "duplicate_record_ids": 0, "num_prompts": 36, "num_answers": 36, "cut_at_max_new_tokens": 9,
        "repetitive_answers": 2}))
    write_json(paths[1], prepared_stats("raw", 10, 9, {"invalid_json": 1}))
    stats = load_stats(paths)
    table = display(stats_table(stats)).set_index("dataset")
    assert list(table.columns[:5]) == ["records read", "dropped by regenerate", "dropped by regenerate by reason",
                                       "records kept", "records skipped"]
    assert table.loc["chat", "records read"] == "40" and table.loc["chat", "dropped by regenerate"] == "4"
    assert table.loc["chat", "dropped by regenerate by reason"] == "duplicate_prompt: 1, empty_content: 2, prompt_too_long: 1"
    assert (table.loc["chat", "records skipped"], table.loc["chat", "records kept"]) == ("1", "35")
    assert tuple(table.loc["raw", ["records read", "dropped by regenerate", "dropped by regenerate by reason"]]) == \
        ("10", "0", "none")
    # regenerate's answer checks: answers cut at max_new_tokens and stuck in a loop (none for a raw dataset)
    assert (table.loc["chat", "cut at the token limit"], table.loc["chat", "loops"]) == ("25.0% (9 of 36)",
                                                                                             "5.6% (2 of 36)")
    assert (table.loc["raw", "cut at the token limit"], table.loc["raw", "loops"]) == ("—", "—")
    empty = pd.DataFrame(columns=["variant", "method", "acceptance_length", "category", "split", "epoch", "step",
                                  "loss", "train tokens", "acceptance length", "datasets"])
    line = next(x for x in findings({}, empty, stats, empty, empty, empty) if x.startswith("Training data"))
    assert "44 conversations kept of 50 read (4 prompts dropped before the target answered, 2 skipped)" in line
    assert "answered n times" not in line
    # two answers per prompt (regenerate.samples_per_prompt: 2): more kept than read, and the line says why
    doubled = stats.assign(records_kept=stats["records_kept"] * 2)
    line = next(x for x in findings({}, empty, doubled, empty, empty, empty) if x.startswith("Training data"))
    assert "88 conversations kept of 50 read (4 prompts dropped before the target answered, 2 skipped; a prompt " \
           "answered n times counts once read and n times kept)" in line
    plot_data_stats(stats, tmp_path / "data_stats.png")
    assert (tmp_path / "data_stats.png").read_bytes().startswith(PNG_MAGIC)
    write_json(paths[0], prepared_stats("chat", 36, 35, {}, {"prompts_dropped": 4}))
    with pytest.raises(ReportInputError, match=r"chat/stats.json: regenerate: missing field\(s\) records_read, "
                                               r"dropped_by_reason"):
        load_stats(paths)


def test_training_table_and_provenance(built, inputs):
    out, _, paths = built
    root, _ = inputs
    shown = html_tables(out / "report.html")
    training = shown["table-training"].set_index("variant")
    for path in paths["metrics"]:
        metrics = pd.read_csv(path)
        variant = metrics["variant"].iloc[0]
        last_val = metrics[metrics["split"] == "val"].iloc[-1]
        assert training.loc[variant, "final val loss"] == fmt(float(last_val["loss"]), 4)
        assert training.loc[variant, f"val full acc {TTT - 1}"] == fmt(float(last_val[f"full_acc_{TTT - 1}"]))
    versions = shown["table-versions"].set_index("package")
    assert versions.loc["vllm", "benchmark wide"] == "0.16.0"
    assert versions.loc["device", "benchmark default"] == "cpu: test (2 cores)"
    inputs_shown = shown["table-inputs"]
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    for path in paths["summaries"] + paths["metrics"] + paths["stats"] + paths["manifests"]:
        assert short_sha(path) in set(inputs_shown["sha256"]), path
        assert f"{sha256_file(path)}  {path}\n" in md and f"{sha256_file(path)}  {path}\n" in html  # sha256sum -c
    config_block = md.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(config_block) == workflow_config(root)


def test_unusable_input_is_named(inputs, tmp_path):
    root, paths = inputs
    broken = tmp_path / "summary.json"
    summary = read_json(paths["summaries"][0])
    del summary["methods"]["eagle3_draft"]["speedup"]
    broken.write_text(json.dumps(summary))
    with pytest.raises(ReportInputError, match=r"summary\.json: methods\.eagle3_draft: missing field\(s\) speedup"):
        build_report(**{**paths, "summaries": [broken, paths["summaries"][1]]}, config={},
                     out_html=tmp_path / "r.html", out_md=tmp_path / "r.md", figures_dir=tmp_path / "figures")
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "figures").exists()


def test_snakemake_rule_and_report(inputs, tmp_path):
    """The real rule runs scripts/report.py; `snakemake --report` then collects every registered figure."""
    from conftest import snakemake, write_config

    root, _ = inputs
    work = tmp_path / "work"
    shutil.copytree(root / "results", work / "results")
    config = workflow_config(root)
    write_config(work, {key: config[key] for key in ("datasets", "variants", "extraction")})
    snakemake(work, "--allowed-rules", "report", "--", str(work / "results" / "report" / "report.html"))
    figures = work / "results" / "report" / "figures"
    assert sorted(p.name for p in figures.glob("*.png")) == sorted(f"{n}.png" for n in DRAWN)
    shown = html_tables(work / "results" / "report" / "report.html")
    assert sorted(set(shown["table-summary"]["variant"])) == sorted(VARIANTS)
    assert sorted(shown["table-data"]["dataset"]) == DATASETS
    assert len(shown["table-shards"]) == len(DATASETS) * NUM_SHARDS
    # the report's own DAG: rule all would also ask for the target, data and shards this copied tree lacks
    snakemake(work, "--allowed-rules", "report", "--report", str(work / "snakemake_report.html"), "--",
              str(work / "results" / "report" / "report.html"))
    text = (work / "snakemake_report.html").read_text()
    for name in DRAWN:
        assert f"{name}.png" in text, name
    assert "Per-position acceptance." in text  # a caption rendered from docs/report_caption.rst


def test_stage_times_name_a_file_that_is_not_a_benchmark_file(tmp_path):
    from draftsmith.report.stage_times import stage_times

    (tmp_path / "train_draft").mkdir()
    (tmp_path / "train_draft" / "default.tsv").write_text("s\th:m:s\tmax_rss\n12.5\t0:00:12\t-\n")
    (tmp_path / "vocab_map.tsv").write_text("s\th:m:s\tmax_rss\n3\t0:00:03\t100.5\n")
    (tmp_path / "report.tsv").write_text("s\n99\n")  # the report's own: an earlier run's, not a stage
    stages = stage_times(tmp_path)
    assert stages["stage"].tolist() == ["vocab_map", "train_draft"]  # the DAG's order
    assert stages["seconds"].tolist() == [3.0, 12.5] and stages["peak memory MB"].iloc[0] == 100.5
    assert stages["peak memory MB"].isna().iloc[1]  # "-": Snakemake could not measure it
    broken = tmp_path / "benchmark" / "default.tsv"
    broken.parent.mkdir()
    broken.write_text("seconds\n1\n")
    with pytest.raises(ValueError, match=f"{broken}: not a Snakemake benchmark file"):
        stage_times(tmp_path)
