"""`draftsmith validate` holds the results tree to the config: every shard it implies must exist."""

from __future__ import annotations

from conftest import write_config

from draftsmith.cli import main


def test_validate_names_each_missing_shard_and_the_command_that_rebuilds_it(tmp_path, capsys):
    config = write_config(tmp_path, {"extraction": {"num_shards": 3}})
    shards = tmp_path / "results" / "shards" / "synthetic"
    (shards / "shard_1").mkdir(parents=True)
    (shards / "shard_1" / "progress.jsonl").write_text("{}\n")  # unfinished, not missing

    assert main(["validate", "--config", str(config)]) == 1  # the results directory comes from the config
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"FAIL {shards}/shard_0: missing: the config has dataset 'synthetic' with extraction.num_shards=3; "
        "`snakemake --cores all` re-extracts it and re-runs what depends on it "
        f"(`snakemake --cores all {shards}/shard_0/manifest.json` re-extracts it alone)",
        f"FAIL {shards}/shard_2: missing: the config has dataset 'synthetic' with extraction.num_shards=3; "
        "`snakemake --cores all` re-extracts it and re-runs what depends on it "
        f"(`snakemake --cores all {shards}/shard_2/manifest.json` re-extracts it alone)",
        f"FAIL {shards}/shard_1: unfinished shard (progress.jsonl without manifest); re-run to resume it",
        "0 passed, 3 failed",
    ]
