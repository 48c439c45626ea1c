"""The workflow's own rules with `extraction.backend: vllm` on the real engine: Snakemake builds the target, prepares
the data, runs preflight and extracts a shard through scripts/extract_hidden_states.py (which validates it), as a
user's run does on a GPU node, here on the engine's CPU platform."""

from __future__ import annotations

import json

import pytest
from conftest import snakemake, write_config
from engine_support import AUX, ENGINE_TARGET, skip_module_unless_engine_runs

skip_module_unless_engine_runs()

from draftsmith.data.tokenization import read_samples  # noqa: E402
from draftsmith.extraction.shards import validate_shard  # noqa: E402

pytestmark = pytest.mark.engine


def test_snakemake_extracts_a_shard_with_the_vllm_backend(tmp_path):
    write_config(tmp_path, {
        "embedded_target": ENGINE_TARGET,
        "synthetic": {"num_records": 40, "num_heldout": 2},
        "extraction": {"backend": "vllm", "num_shards": 1, "aux_layer_ids": AUX, "dtype": "float32", "batch_size": 16,
                       "tensor_parallel_size": 1},
    })
    results = tmp_path / "results"
    manifest_path = results / "shards" / "synthetic" / "shard_0" / "manifest.json"
    snakemake(tmp_path, str(manifest_path))
    manifest = json.loads(manifest_path.read_text())
    assert manifest["backend"] == "vllm" and manifest["dtype"] == "float32"
    assert manifest["vllm"]["fixes_applied"]
    assert json.loads((results / "preflight.json").read_text())["ok"]
    validate_shard(manifest_path.parent, read_samples(results / "prepared" / "synthetic" / "samples.parquet"), deep=True)
