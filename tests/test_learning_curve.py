"""The learning curve of a real run: the tiny pipeline with three data_fraction variants (10%, 30% and all of the
training samples, 10x apart), its report's table and learning_curve.csv, and `python -m perf learning_curve` on the same tree,
checked against the benchmark's summary.json and the drafts' metrics.csv and training_data.json."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import yaml
from conftest import snakemake

from draftsmith.io import read_json
from perf import learning_curve, partial_report

VARIANTS = {"default": {}, "data_10": {"data_fraction": 0.1}, "data_30": {"data_fraction": 0.3}}
REQUIRED = ["variant", "data_fraction", "train_tokens", "acceptance_length", "predicted_acceptance_length", "speedup"]


@pytest.fixture(scope="module")
def curve_run(pipeline_run, tmp_path_factory):
    """The session's run copied (its shards, vocab map and default draft kept), with two smaller variants added."""
    workdir = tmp_path_factory.mktemp("learning_curve")
    shutil.copytree(pipeline_run / "results", workdir / "results")  # copy2: mtimes kept, so nothing upstream re-runs
    config = yaml.safe_load((pipeline_run / "config.yaml").read_text())
    config["results"] = str(workdir / "results")
    config["variants"] = VARIANTS
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    snakemake(workdir)
    return workdir / "results"


def expected_row(results, variant: str) -> dict:
    """What a learning-curve row must say, read from the files the pipeline wrote."""
    summary = read_json(results / "benchmark" / variant / "summary.json")
    draft = summary["methods"]["eagle3_draft"]
    data = read_json(results / "draft" / variant / "training_data.json")
    metrics = pd.read_csv(results / "draft" / variant / "metrics.csv")
    last_val = metrics[metrics["split"] == "val"].iloc[-1]
    steps = sorted(int(c.removeprefix("full_acc_")) for c in metrics.columns if c.startswith("full_acc_"))
    accs = [float(last_val[f"full_acc_{i}"]) for i in steps]
    return {"summary": summary, "draft": draft, "data": data, "last_val": last_val, "accs": accs}


def test_report_writes_the_learning_curve_from_the_runs_own_files(curve_run):
    curve = pd.read_csv(curve_run / "report" / "learning_curve.csv")
    assert set(REQUIRED) <= set(curve.columns)
    assert sorted(curve["variant"]) == sorted(VARIANTS)
    assert curve["train_tokens"].is_monotonic_increasing
    assert curve["train_tokens"].iloc[-1] >= 8 * curve["train_tokens"].iloc[0]  # ~10x apart
    for row in curve.to_dict("records"):
        e = expected_row(curve_run, row["variant"])
        k = e["summary"]["num_speculative_tokens"]
        assert row["data_fraction"] == VARIANTS[row["variant"]].get("data_fraction", 1.0) == e["data"]["data_fraction"]
        assert (row["train_samples"], row["train_tokens"]) == (e["data"]["train_samples"], e["data"]["train_tokens"])
        assert row["acceptance_length"] == pytest.approx(e["draft"]["acceptance_length"])
        assert row["tokens_per_drafted_round"] == pytest.approx(e["draft"]["tokens_per_drafted_round"])
        assert row["speedup"] == pytest.approx(e["draft"]["speedup"])
        assert row["num_speculative_tokens"] == k
        assert [row[f"val_full_acc_{i}"] for i in range(len(e["accs"]))] == pytest.approx(e["accs"])
        assert row["predicted_acceptance_length"] == pytest.approx(1 + sum(e["accs"][:k]))
        # k = the trained TTT steps here: the prediction training wrote into metrics.csv and training_data.json
        assert k == len(e["accs"])
        assert row["predicted_acceptance_length"] == pytest.approx(e["last_val"]["predicted_acceptance_length"])
        assert row["predicted_acceptance_length"] == pytest.approx(e["data"]["validation"]["predicted_acceptance_length"])
        log = (curve_run / "logs" / "train_draft" / f"{row['variant']}.log").read_text()
        assert f"predicted acceptance length {e['last_val']['predicted_acceptance_length']:.3f} tokens per drafted" in log
    assert len(set(curve["train_tokens"])) == len(VARIANTS)


def test_report_shows_the_learning_curve_table_beside_its_figure(curve_run):
    md = (curve_run / "report" / "report.md").read_text()
    section = md.split("## Learning curve: training data, predicted and measured acceptance\n\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == ["variant", "datasets", "data fraction", "train samples", "train tokens",
                      "val full acc per TTT step", "predicted acceptance length", "acceptance length",
                      "tokens per drafted round", "speedup"]
    rows = {cells[0]: dict(zip(header, cells)) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in table[1:])}
    assert sorted(rows) == sorted(VARIANTS)
    curve = pd.read_csv(curve_run / "report" / "learning_curve.csv").set_index("variant")
    for variant, shown in rows.items():
        assert shown["predicted acceptance length"] == f"{curve.loc[variant, 'predicted_acceptance_length']:.3f}"
        assert shown["acceptance length"] == f"{curve.loc[variant, 'acceptance_length']:.3f}"
        assert shown["speedup"] == f"{curve.loc[variant, 'speedup']:.2f}"
    assert "![Learning curve" in section and "figures/data_size.png" in section
    png = (curve_run / "report" / "figures" / "data_size.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_perf_script_writes_the_same_curve_from_the_results_tree(curve_run, tmp_path, capsys):
    out = tmp_path / "smollm2_learning_curve.csv"
    learning_curve.main(["--results", str(curve_run), "--out", str(out)])
    printed = capsys.readouterr().out
    ours, report = pd.read_csv(out), pd.read_csv(curve_run / "report" / "learning_curve.csv")
    pd.testing.assert_frame_equal(ours, report)
    assert all(v in printed for v in VARIANTS) and "predicted_acceptance_length" in printed
    assert json.loads(ours.to_json(orient="records"))[0]["variant"] == "data_10"  # the smallest first


def test_partial_report_of_a_run_cut_short_before_one_variants_benchmark(curve_run, tmp_path, capsys):
    """perf.partial_report: the same report from a results tree where one variant was trained but not benchmarked
    (a GPU session that ran out): its curve row keeps the validation prediction and has no measurement."""
    results = tmp_path / "results"
    shutil.copytree(curve_run, results)
    shutil.rmtree(results / "benchmark" / "data_30")
    partial_report.main(["--results", str(results), "--out", str(tmp_path / "report"),
                         "--configfile", str(curve_run.parent / "config.yaml")])
    assert "not benchmarked: data_30" in capsys.readouterr().out
    partial = pd.read_csv(tmp_path / "report" / "learning_curve.csv").set_index("variant")
    full = pd.read_csv(curve_run / "report" / "learning_curve.csv").set_index("variant")
    assert sorted(partial.index) == sorted(VARIANTS)
    assert pd.isna(partial.loc["data_30", "acceptance_length"]) and pd.isna(partial.loc["data_30", "speedup"])
    assert partial.loc["data_30", "predicted_acceptance_length"] == full.loc["data_30", "predicted_acceptance_length"]
    # (check_dtype: a column with the missing row's NaN in it reads back as float)
    pd.testing.assert_frame_equal(partial.drop(index="data_30"), full.drop(index="data_30"), check_dtype=False)
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## Learning curve" in md and "`data_30`" not in md.split("## Benchmark summary", 1)[1].split("\n## ", 1)[0]
