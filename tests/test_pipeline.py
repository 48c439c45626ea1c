"""The embedded default end to end with Snakemake, plus targeted rebuilds and rerun triggers."""

import json
import re
import time

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import REPO, SNAKEMAKE, jobs_planned, snakemake, write_config
from test_report import html_tables

from draftsmith.data.tokenization import read_samples
from draftsmith.extraction.shards import validate_shard
from draftsmith.io import sha256_file
from draftsmith.vocab import coverage_line
from perf import round_costs


def test_spine_outputs_are_real_and_consistent(pipeline_run):
    r = pipeline_run / "results"
    stats = json.loads((r / "prepared" / "synthetic" / "stats.json").read_text())
    samples = read_samples(r / "prepared" / "synthetic" / "samples.parquet")
    assert stats["records_kept"] == len(samples["sample_id"]) == 160 and stats["records_skipped"] == 0
    assert all(sum(m) > 0 for m in samples["loss_mask"])
    assert all(len(i) <= 256 for i in samples["input_ids"])
    seen = []
    for shard in range(2):
        manifest = validate_shard(r / "shards" / "synthetic" / f"shard_{shard}", samples, deep=True)
        assert manifest["aux_layer_ids"] == [1, 3, 4] and manifest["dtype"] == "float32"
        seen += [e["index"] for e in manifest["samples"]]
        data = torch.load(r / "shards" / "synthetic" / f"shard_{shard}" / manifest["samples"][0]["file"], weights_only=True)
        assert [s.dtype for s in data["hidden_states"]] == [torch.float32] * 4
    assert sorted(seen) == list(range(160))
    d2t, t2d = np.load(r / "vocab" / "d2t.npy"), np.load(r / "vocab" / "t2d.npy")
    assert d2t.shape == (256,) and t2d.shape == (512,) and t2d.sum() == 256
    assert np.array_equal(np.flatnonzero(t2d), np.arange(256) + d2t)


def test_draft_benchmark_and_report_exist(pipeline_run):
    r = pipeline_run / "results"
    config = json.loads((r / "draft" / "default" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and config["speculators_model_type"] == "eagle3"
    metrics = pd.read_csv(r / "draft" / "default" / "metrics.csv")
    train = metrics[metrics.split == "train"]
    assert train.loss.iloc[-3:].mean() < train.loss.iloc[:3].mean()
    per_prompt = pd.read_csv(r / "benchmark" / "default" / "per_prompt.csv")
    assert set(per_prompt.method) == {"target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft"}
    assert len(per_prompt) == 4 * 3
    html = (r / "report" / "report.html").read_text()
    assert "eagle3_draft" in html and html.count("data:image/png;base64,") >= 6


def test_report_times_every_stage_from_its_benchmark_files(pipeline_run):
    """The report's time per stage is the rules' Snakemake benchmark files, summed per rule (the report's own is
    written after it)."""
    r = pipeline_run / "results"
    files = [p for p in (r / "benchmarks").rglob("*.tsv") if p.relative_to(r / "benchmarks").parts[0] != "report.tsv"]
    want = {}
    for path in files:
        stage = path.relative_to(r / "benchmarks").parts[0].removesuffix(".tsv")
        jobs, seconds = want.get(stage, (0, 0.0))
        want[stage] = (jobs + 1, seconds + float(pd.read_csv(path, sep="\t")["s"].iloc[0]))
    assert {"extract_hidden_states", "train_draft", "benchmark"} <= set(want)
    table = html_tables(r / "report" / "report.html")["table-stages"]
    got = {row["stage"]: (int(row["jobs"]), float(str(row["seconds"]).replace(",", ""))) for _, row in table.iterrows()}
    assert got.keys() == want.keys()
    for stage, (jobs, seconds) in want.items():
        assert got[stage][0] == jobs and got[stage][1] == pytest.approx(seconds, abs=0.01), stage
    assert "From raw data to the benchmarked draft the jobs took" in (r / "report" / "report.md").read_text()


def test_round_costs_reads_the_benchmarks_per_prompt_table(pipeline_run):
    """perf.round_costs on the run's per_prompt.csv: a row per method, with summary.json's acceptance lengths and
    speedups, and the first-of-a-length split covering the run's prompts."""
    bench = pipeline_run / "results" / "benchmark" / "default"
    per_prompt = pd.read_csv(bench / "per_prompt.csv")
    table = round_costs.round_costs(per_prompt).set_index("method")
    summary = json.loads((bench / "summary.json").read_text())["methods"]
    assert set(table.index) == set(summary)
    for method, entry in summary.items():
        assert table.loc[method, "acceptance length"] == pytest.approx(entry["acceptance_length"])
        assert table.loc[method, "speedup, all"] == pytest.approx(entry["speedup"])
    lengths = per_prompt.drop_duplicates("prompt_id")["prompt_tokens"]
    assert (table["first-of-length prompts"] == lengths.nunique()).all()


def test_noop_rerun_targeted_rebuild_and_rerun_triggers(run_copy):
    workdir = run_copy
    r = workdir / "results"
    start = time.perf_counter()
    noop = snakemake(workdir, "-n")
    assert "Nothing to be done" in noop.stdout + noop.stderr
    assert time.perf_counter() - start < 30  # the timing target (<= 3 s) is measured by a benchmark, not here

    # changing draft_vocab_size re-runs only the vocab map and what depends on it (tests/test_rebuilds.py: every key)
    changed = workdir / "changed.yaml"
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["vocab"]["draft_vocab_size"] = 128
    changed.write_text(yaml.safe_dump(config))
    planned = jobs_planned(snakemake(workdir, "-n", "--configfile", str(changed)))
    assert planned == {"all": 1, "vocab_map": 1, "train_draft": 1, "benchmark": 1, "report": 1}

    # asking for one file builds only what it needs, and the rebuilt map is identical
    before = sha256_file(r / "vocab" / "d2t.npy")
    (r / "vocab" / "d2t.npy").unlink()
    proc = snakemake(workdir, str(r / "vocab" / "d2t.npy"))
    assert jobs_planned(proc) == {"vocab_map": 1}
    assert sha256_file(r / "vocab" / "d2t.npy") == before


def test_single_target_on_a_fresh_tree_plans_only_its_inputs(tmp_path):
    write_config(tmp_path)
    planned = jobs_planned(snakemake(tmp_path, "-n", str(tmp_path / "results" / "vocab" / "d2t.npy")))
    assert planned == {"make_synthetic_corpus": 1, "build_target": 1, "prepare_dataset": 1, "token_freq": 1, "vocab_map": 1}


def test_workflow_lints_clean():
    import subprocess

    proc = subprocess.run([SNAKEMAKE, "--lint", "-s", str(REPO / "Snakefile")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations, your workflow is in a good condition" in proc.stdout + proc.stderr


@pytest.mark.slow  # minutes alone: `make test-slow` and CI run it
def test_two_datasets_and_two_variants_run_end_to_end(pipeline_run, tmp_path):
    """Issue 7: datasets combine into one vocab map and one training set; variants land side by side."""
    from conftest import copy_inputs

    from draftsmith.data.synthetic import generate_corpus
    from draftsmith.io import write_jsonl

    extra, _ = generate_corpus(60, 1, seed=7)
    sharegpt = [{"id": r["id"], "conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                                   "value": m["content"]} for m in r["messages"]]} for r in extra]
    write_jsonl(tmp_path / "extra.jsonl", sharegpt)
    workdir = copy_inputs(pipeline_run, tmp_path / "w")
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["datasets"] = {"synthetic": {"source": "synthetic"}, "extra": {"source": "local", "path": str(tmp_path / "extra.jsonl")}}
    config["variants"] = {"default": {}, "deep": {"draft_layers": 2, "epochs": 1}}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(workdir)

    r = workdir / "results"
    freqs = [torch.load(r / "vocab" / d / "token_freq.pt", weights_only=True) for d in ("synthetic", "extra")]
    combined = torch.load(r / "vocab" / "token_freq.pt", weights_only=True)
    assert combined == {t: freqs[0].get(t, 0) + freqs[1].get(t, 0) for t in set(freqs[0]) | set(freqs[1])}
    vocab_log = (r / "logs" / "vocab_map.log").read_text()  # the coverage line, from the combined counts
    assert coverage_line(combined, len(np.load(r / "vocab" / "d2t.npy")), 512) in vocab_log
    assert json.loads((r / "prepared" / "extra" / "stats.json").read_text())["records_kept"] == 60
    manifests = sorted(r.glob("shards/*/shard_*/manifest.json"))
    assert {m.parent.parent.name for m in manifests} == {"synthetic", "extra"}
    for variant, layers in (("default", 1), ("deep", 2)):
        draft = json.loads((r / "draft" / variant / "config.json").read_text())
        assert draft["transformer_layer_config"]["num_hidden_layers"] == layers
        assert json.loads((r / "benchmark" / variant / "summary.json").read_text())["variant"] == variant
    assert sum(json.loads(m.read_text())["num_samples"] for m in manifests) == 160 + 60
    log = (workdir / "results" / "logs" / "train_draft" / "default.log").read_text()
    match = re.search(r"training on (\d+) samples \(\d+ tokens; data_fraction 1.0\), hidden states read from shards "
                      r"from (\S+(?:, \S+)*); (\d+) samples held out", log)
    assert match and int(match.group(1)) + int(match.group(3)) == 160 + 60
    assert len(match.group(2).split(", ")) == 4  # two shards of each dataset
    # the rule points torch.compile's cache at its results tree (nothing compiles on the CPU: zero graphs)
    assert f"0 graphs from the cache, 0 compiled ({(workdir / 'results' / '.cache' / 'torch_compile').resolve()})" in log
    report = (r / "report" / "report.md").read_text()
    assert "deep" in report and "extra" in report and "default" in report
