"""Online hidden states (training.hidden_states: online): the target runs on each training batch, no shards.

Against the offline path on the same samples: the batches the trainer sees (states within float32 rounding, all else
equal), the losses of the first steps, a killed and resumed run, and the workflow (no extraction job, validate).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import yaml
from conftest import copy_run, jobs_planned, snakemake
from test_training import AUX, TRAINING, train, training_inputs  # noqa: F401 (a fixture)

from draftsmith.io import read_json
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.loader import make_loader, training_split
from draftsmith.training.sources import OnlineStates, ShardStates

# the hf extraction backend's settings of the offline shards (tests/test_training.py: batch_tokens 1024, 8 rows)
ONLINE = {"aux_layer_ids": AUX, "dtype": "float32", "batch_tokens": 1024, "max_batch_size": 8}
# states computed in other padded batches than the shards' differ by float32 rounding
STATES_ATOL = 1e-5
LOSS_RTOL = 1e-5


def online(inputs) -> OnlineStates:
    return OnlineStates([inputs["samples"]], ONLINE)


def test_online_batches_equal_the_offline_ones(training_inputs, tiny_target):  # noqa: F811
    target = TargetSpec(str(tiny_target))
    offline = training_split(ShardStates(training_inputs["manifests"]), TRAINING)
    ours = training_split(online(training_inputs), TRAINING)
    # the same samples in the same order (two shards offline: the order does not depend on the shard count)
    assert offline[1][1] == ours[1][1] and offline[2][1] == ours[2][1] and len(ours[1][1]) > 20
    args = dict(world_size=1, rank=0, seed=0, num_workers=0, pin_memory=False, target=target)
    loaders = [make_loader(*split[1], 256, 0.05, source=split[0], **args) for split in (offline, ours)]
    worst = 0.0
    batches = 0
    for a, b in zip(*loaders, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if "hidden_states" in key:
                assert a[key].dtype == b[key].dtype == torch.float32
                worst = max(worst, (a[key] - b[key]).abs().max().item())
            else:
                assert torch.equal(a[key], b[key]), key
        batches += 1
    print(f"online vs shard states over {batches} batches (noise included): max |difference| {worst:.3g}")
    assert batches > 3 and worst <= STATES_ATOL


def test_the_first_losses_equal_offline_training(training_inputs, tiny_target):  # noqa: F811
    _, offline = train(training_inputs, tiny_target, "offline_reference", epochs=1, noise_std=0.05)
    _, ours = train(training_inputs, tiny_target, "online", states=online(training_inputs), epochs=1, noise_std=0.05)
    rows = [(a, b) for a, b in zip(offline, ours, strict=True) if a["split"] == "train"]
    assert len(rows) > 5 and all(a["step"] == b["step"] for a, b in rows)
    difference = max(abs(float(a["loss"]) / float(b["loss"]) - 1) for a, b in rows[:5])
    print(f"first 5 steps: largest relative loss difference online vs offline {difference:.3g}")
    assert difference <= LOSS_RTOL
    summary = read_json(training_inputs["root"] / "online" / "training_data.json")
    assert summary["hidden_states"] == "online"


def test_a_killed_online_run_resumes_to_the_uninterrupted_draft(training_inputs, tiny_target):  # noqa: F811
    settings = dict(epochs=2, scheduler="linear", noise_std=0.05)
    out, uninterrupted = train(training_inputs, tiny_target, "online_resumed", states=online(training_inputs), **settings)
    served = (out / "model.safetensors").read_bytes()
    shutil.rmtree(out / "state" / "checkpoints" / "1")  # killed during the last epoch
    torch.manual_seed(12345)
    np.random.seed(12345)
    _, resumed = train(training_inputs, tiny_target, "online_resumed", states=online(training_inputs), **settings)
    assert (out / "model.safetensors").read_bytes() == served
    assert [{k: v for k, v in r.items() if k != "wall"} for r in resumed] == \
        [{k: v for k, v in r.items() if k != "wall"} for r in uninterrupted]


def test_an_online_workflow_extracts_nothing_and_validates(pipeline_run, tmp_path):
    workdir = copy_run(pipeline_run, tmp_path / "run", overrides={"training": {"hidden_states": "online"}})
    plan = jobs_planned(snakemake(workdir, "-n"))
    assert plan == {"all": 1, "train_draft": 1, "benchmark": 1, "report": 1}, plan
    shutil.rmtree(workdir / "results" / "shards")  # not an input of anything now
    snakemake(workdir)
    r = workdir / "results"
    summary = read_json(r / "draft" / "default" / "training_data.json")
    assert summary["hidden_states"] == "online" and "samples" in summary["inputs"] and "shards" not in summary["inputs"]
    assert not (r / "shards").exists()
    log = (r / "logs" / "train_draft" / "default.log").read_text()
    assert "hidden states computed online by the target on cpu" in log
    proc = snakemake(workdir, "validate")
    assert "0 failed" in proc.stdout + proc.stderr
    # an extraction setting that sets the states online re-runs training, and no extraction job
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["extraction"]["batch_tokens"] = 512
    (workdir / "changed.yaml").write_text(yaml.safe_dump(config))
    plan = jobs_planned(snakemake(workdir, "-n", "--configfile", str(workdir / "changed.yaml")))
    assert plan == {"all": 1, "train_draft": 1, "benchmark": 1, "report": 1}, plan


@pytest.mark.parametrize("batch_tokens,status", [(2048, "ok"), (10**9, "fail")])
def test_preflight_says_whether_online_training_fits(pipeline_run, tmp_path, batch_tokens, status):
    from draftsmith.config.workflow import load_config
    from draftsmith.vllm_stack.preflight import run_preflight

    config = yaml.safe_load((pipeline_run / "config.yaml").read_text())
    config["training"]["hidden_states"] = "online"
    config["extraction"]["batch_tokens"] = batch_tokens
    (tmp_path / "online.yaml").write_text(yaml.safe_dump(config))
    report = run_preflight(load_config([str(tmp_path / "online.yaml")]), str(pipeline_run / "results" / "target"),
                           gpus=0)
    checks = [c for c in report.checks if c.name == "memory (online)"]
    assert [c.status for c in checks] == [status], report.lines()
    assert ("set training.hidden_states: offline" in checks[0].message) == (status == "fail")
    assert report.ok == (status == "ok"), report.problems
    assert any("no shards: training.hidden_states is online" in line for line in report.lines())
