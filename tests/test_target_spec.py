"""One target spec (model, revision, trust_remote_code, dtype) reaches every rule that loads the target."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import snakemake

from draftsmith.target_model.remote_code import RemoteCodeError, remote_code_checked
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


def with_auto_map(target: Path, out: Path, model_type: str | None = None) -> Path:
    """A copy of `target` whose config.json has `auto_map` (and, given, a model type transformers does not know), as
    a model repository that ships its own code has."""
    shutil.copytree(target, out)
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_tiny.TinyConfig",
                          "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}
    if model_type:
        config["model_type"] = model_type
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_every_loader_refuses_a_local_target_with_auto_map_naming_the_config_key(tmp_path):
    """config.json with auto_map and trust_remote_code off: each loader stops before transformers, naming
    target.trust_remote_code and the model (transformers loads a known model type's own classes silently, and
    fails with its own text on an unknown one)."""
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "c.C"}}))
    spec = TargetSpec(str(model))
    loaders = {"load_tokenizer": spec.load_tokenizer, "load_text_config": spec.load_text_config,
               "load_causal_lm": lambda: spec.load_causal_lm(torch.float32),
               "load_generation_config": spec.load_generation_config}  # regenerate's stop tokens, without weights
    for name, load in loaders.items():
        with pytest.raises(RemoteCodeError) as e:
            load()
        assert "target.trust_remote_code: true" in str(e.value) and str(model) in str(e.value), name
        assert "auto_map" in str(e.value), name


def test_transformers_refusal_of_remote_code_becomes_the_same_error():
    """A hub id is not read before loading: transformers' own refusal is re-raised with draftsmith's message."""
    from transformers.dynamic_module_utils import resolve_trust_remote_code

    with pytest.raises(RemoteCodeError) as e, remote_code_checked("org/custom-model", False):
        resolve_trust_remote_code(False, "org/custom-model", has_local_code=False, has_remote_code=True)
    assert "target org/custom-model:" in str(e.value) and "target.trust_remote_code: true" in str(e.value)
    assert "contains custom code" in str(e.value)  # transformers' first line, for the record
    with pytest.raises(ValueError, match="something else"), remote_code_checked("org/custom-model", False):
        raise ValueError("something else")  # other errors pass through unchanged
    with remote_code_checked("org/custom-model", True):  # opted in: nothing to check
        pass


def test_a_local_target_with_auto_map_stops_the_workflow_with_draftsmiths_message(tiny_target, tmp_path):
    """The first-hour case: a local target that ships its own code, trust_remote_code left off. The rules that load
    it without a preflight gate (prepare_dataset, and vocab_map behind it) stop with draftsmith's message on the
    console and in the rule's log, not transformers' text."""
    from conftest import write_config

    model = with_auto_map(tiny_target, tmp_path / "custom_target", model_type="tiny_custom")
    write_config(tmp_path, {"target": {"model": str(model), "revision": None, "trust_remote_code": False}})
    results = tmp_path / "results"
    proc = snakemake(tmp_path, "--keep-going", str(results / "prepared" / "synthetic" / "stats.json"),
                     str(results / "vocab" / "d2t.npy"), check=False)
    assert proc.returncode != 0
    message = f"target {model}: its config.json has auto_map"
    assert message in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    log = (results / "logs" / "prepare_dataset" / "synthetic.log").read_text()
    assert message in log and "target.trust_remote_code: true" in log
    assert "RemoteCodeError" in log and "contains custom code" not in log
