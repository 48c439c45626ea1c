"""One target spec (model, revision, trust_remote_code, dtype) reaches every rule that loads the target."""

import yaml
from conftest import snakemake

from draftsmith.target_model.spec import TargetSpec

# one output of each rule; the first group loads the target (tokenizer, config or weights) or, the report,
# shows the whole config; the second never loads it
LOADS_TARGET = {"prepare_dataset": "prepared/synthetic/stats.json",
                "extract_hidden_states": "shards/synthetic/shard_0/manifest.json", "vocab_map": "vocab/d2t.npy",
                "train_draft": "draft/default/config.json", "benchmark": "benchmark/default/summary.json",
                "report": "report/report.html"}
IGNORES_TARGET = {"make_synthetic_corpus": "data/synthetic/train.jsonl", "build_target": "target",
                  "benchmark_prompts": "benchmark/prompts.jsonl",
                  "token_freq": "vocab/synthetic/token_freq.pt"}


def test_spec_round_trips_through_the_dict_rules_and_torchrun_pass():
    spec = TargetSpec("org/model", revision="abc", trust_remote_code=True, dtype="bfloat16")
    assert TargetSpec.from_dict(spec.to_dict()) == spec
    assert spec.stage_dtype("auto") == "bfloat16" and spec.stage_dtype("float32") == "float32"


def test_every_rule_that_loads_the_target_gets_its_options(pipeline_run, tmp_path):
    """Turning on trust_remote_code and pinning a revision changes the params of exactly the rules that load
    the target, so each of them re-runs (train_draft once loaded the target without them, and a spec computed
    from a job's input is not compared by Snakemake at all).

    Each rule is planned alone (--allowed-rules, one of its outputs as the target), so its own reason is seen."""
    config = yaml.safe_load((pipeline_run / "config.yaml").read_text())
    config["target"] = {"model": "embedded", **config.get("target", {}), "trust_remote_code": True, "revision": "v1"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    results = pipeline_run / "results"
    for rule, output in {**LOADS_TARGET, **IGNORES_TARGET}.items():
        proc = snakemake(pipeline_run, "--configfile", str(tmp_path / "config.yaml"), "-n", "--nolock",
                         "--rerun-triggers", "params", "--allowed-rules", rule, "--", str(results / output))
        planned = "Params have changed since last execution" in proc.stdout + proc.stderr
        assert planned == (rule in LOADS_TARGET), f"{rule}: {(proc.stdout + proc.stderr)[-1500:]}"
