"""`validate` holds the results tree to the config: every output it implies exists, is intact, and was made from the
current target, shards, vocab map and prompts; `snakemake validate` and `snakemake preflight` run every time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import snakemake, write_config

from draftsmith.cli import main


@pytest.fixture(scope="module")
def run(up_to_date_run):
    """The session's finished tiny run, up to date."""
    return up_to_date_run


def test_validate_names_each_missing_output_and_the_command_that_rebuilds_it(tmp_path, capsys):
    config = write_config(tmp_path, {"extraction": {"num_shards": 3}})
    r = tmp_path / "results"
    shards = r / "shards" / "synthetic"
    (shards / "shard_1").mkdir(parents=True)
    (shards / "shard_1" / "progress.jsonl").write_text("{}\n")  # unfinished, not missing

    assert main(["validate", "--config", str(config)]) == 1  # the results directory comes from the config
    out = capsys.readouterr().out.splitlines()
    plain = f"snakemake --cores all --configfile {config}"  # the user's config file: with it, the plan is theirs
    for shard in (0, 2):
        assert (f"FAIL {shards}/shard_{shard}: missing: the config implies this shard (rule extract_hidden_states); "
                f"`{plain}` rebuilds it and re-runs what depends on it "
                f"(`snakemake --cores all {shards}/shard_{shard}/manifest.json --configfile {config}` rebuilds it "
                "alone)") in out
    assert f"FAIL {shards}/shard_1: unfinished shard (progress.jsonl without manifest); `{plain}` resumes it" in out
    for output in ("vocab/d2t.npy", "draft/default/model.safetensors", "benchmark/default/summary.json", "report/report.html"):
        assert any(line.startswith(f"FAIL {r / output}: missing: the config implies this output") for line in out), output
    assert out[-1].endswith("failed") and out[-1].startswith("0 passed")


def console(proc) -> str:
    return proc.stdout + proc.stderr


def test_snakemake_validate_and_preflight_run_every_time_and_print_their_verdict(run):
    for _ in range(2):
        proc = snakemake(run, "validate")
        assert "Nothing to be done" not in console(proc)
        # paths as Snakemake spells them: the results tree lies under the working directory
        assert "failed (log: results/logs/validate.log)" in proc.stdout and "validate: " in proc.stdout
        assert ", 0 failed" in proc.stdout
        proc = snakemake(run, "preflight")
        assert "Nothing to be done" not in console(proc)
        assert "preflight: ok (log: results/logs/preflight.log)" in proc.stdout and "[  ok] layer ids" in proc.stdout


def test_validate_requires_the_vocab_map_and_names_what_is_missing(run, tmp_path):
    d2t = run / "results" / "vocab" / "d2t.npy"
    shutil.copy2(d2t, tmp_path / "d2t.npy")
    try:
        d2t.unlink()
        proc = snakemake(run, "validate", check=False)
    finally:
        shutil.copy2(tmp_path / "d2t.npy", d2t)
    assert proc.returncode != 0
    assert "FAIL results/vocab/d2t.npy: missing: the config implies this output (rule vocab_map)" in proc.stdout


def test_validate_finds_drafts_and_benchmarks_made_from_another_target(run, tmp_path):
    """The target's weights rewritten in place: the shards, the draft and the benchmark no longer describe it."""
    r = run / "results"
    weights = r / "target" / "model.safetensors"
    shutil.copy2(weights, tmp_path / "model.safetensors")
    try:
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
        proc = snakemake(run, "validate", check=False)
    finally:
        shutil.copy2(tmp_path / "model.safetensors", weights)
    assert proc.returncode != 0
    out, r = proc.stdout, Path("results")  # as Snakemake spells the tree under its working directory
    assert f"FAIL {r / 'shards' / 'synthetic' / 'shard_0'}: ValueError: extracted from another target" in out
    assert (f"FAIL {r / 'draft' / 'default'}: ValueError: made from other target, shards or vocab map than the current "
            "ones (changed: target.weights_sha256.model.safetensors)") in out
    assert (f"FAIL {r / 'benchmark' / 'default' / 'summary.json'}: ValueError: made from other draft, prompts or target "
            "than the current ones (changed: target.weights_sha256.model.safetensors)") in out
    assert ", 0 failed" in snakemake(run, "validate").stdout


def test_validate_accepts_the_results_tree_named_another_way(run, tmp_path, monkeypatch, capsys):
    """`draftsmith validate results --config my.yaml` (README): the run recorded its shard and target paths as its config
    spelled them (here absolute); a relative path or a symlink to the same tree is the same tree (it was "made from
    other target, shards or vocab map (changed: shards.<path>, target.path)")."""
    config = run / "config.yaml"
    (tmp_path / "linked").symlink_to(run / "results")
    monkeypatch.chdir(tmp_path)
    for results in ("linked", os.path.relpath(run / "results", tmp_path)):
        assert main(["validate", results, "--config", str(config)]) == 0, capsys.readouterr().out[-3000:]
        assert capsys.readouterr().out.splitlines()[-1].endswith(" 0 failed")
