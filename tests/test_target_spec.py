"""One target spec (model, revision, trust_remote_code, dtype) reaches every rule that loads the target."""

import yaml
from conftest import snakemake

from draftsmith.target_model.spec import TargetSpec

# the rules that load the target (tokenizer, config or weights), by where their outputs go
LOADS_TARGET = {
    "prepare_dataset": "prepared/synthetic/",
    "preflight": "preflight.json",
    "extract_hidden_states": "shards/synthetic/shard_0/",
    "vocab_map": "vocab/d2t.npy",
    "train_draft": "draft/default/",
    "benchmark": "benchmark/default/",
}
# rules that never load it: their params must not change with it
IGNORES_TARGET = ["data/", "target", "vocab/synthetic/"]


def test_spec_round_trips_through_the_dict_rules_and_torchrun_pass():
    spec = TargetSpec("org/model", revision="abc", trust_remote_code=True, dtype="bfloat16")
    assert TargetSpec.from_dict(spec.to_dict()) == spec
    assert spec.stage_dtype("auto") == "bfloat16" and spec.stage_dtype("float32") == "float32"


def test_every_rule_that_loads_the_target_gets_its_options(pipeline_run, tmp_path):
    """Turning on trust_remote_code changes the params of exactly the rules that load the target.

    `--list-changes params` compares each output's recorded params with the new config's, so a rule
    that did not get the target's options (train_draft once did not) would be missing here."""
    config = yaml.safe_load((pipeline_run / "config.yaml").read_text())
    config["target"] = {**config.get("target", {"model": "embedded"}), "trust_remote_code": True, "revision": "v1"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(pipeline_run, "--configfile", str(tmp_path / "config.yaml"), "--list-changes", "params", "--nolock")
    results = config["results"] + "/"
    changed = [line.strip().removeprefix(results) for line in proc.stdout.splitlines() if line.strip()]
    for rule, where in LOADS_TARGET.items():
        assert any(path.startswith(where) for path in changed), f"{rule} does not get the target spec: {changed}"
    for where in IGNORES_TARGET:
        assert not any(path == where or path.startswith(where) and where.endswith("/") for path in changed), where
