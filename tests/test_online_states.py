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
from draftsmith.training.online import plan_forwards
from draftsmith.training.prefetch import PrefetchingLoader
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
    from draftsmith.preflight import run_preflight

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


def test_prefetched_batches_are_the_loaders_own(training_inputs, tiny_target):  # noqa: F811
    """The thread that loads online batches ahead changes nothing in them, nor in their order."""
    source, keys, _ = training_split(online(training_inputs), TRAINING)
    args = dict(world_size=1, rank=0, seed=0, num_workers=0, pin_memory=False, target=TargetSpec(str(tiny_target)),
                source=source)
    ahead = make_loader(*keys, 256, 0.05, prefetch_batches=2, **args)
    serial = make_loader(*keys, 256, 0.05, **args)  # on a CPU the default: no thread
    assert isinstance(ahead, PrefetchingLoader) and not isinstance(serial, PrefetchingLoader)
    assert len(ahead) == len(serial) and ahead.batch_sampler is not None
    for epoch in (0, 1):
        for loader in (ahead, serial):
            loader.batch_sampler.set_epoch(epoch)
        pairs = list(zip(ahead, serial, strict=True))
        assert len(pairs) > 3
        for a, b in pairs:
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _FailsAt(torch.utils.data.Dataset):
    def __init__(self, bad: int):
        self.bad = bad

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i}: broken")
        return {"x": torch.tensor(i)}


def test_prefetching_raises_the_loaders_error_and_stops_its_thread():
    import threading

    before = threading.active_count()
    loader = PrefetchingLoader(torch.utils.data.DataLoader(_FailsAt(6), batch_size=2), depth=2, device="cpu")
    seen = []
    with pytest.raises(ValueError, match="sample 6: broken"):
        for batch in loader:
            seen.append(batch["x"].tolist())
    assert seen == [[0, 1], [2, 3], [4, 5]]
    for batch in PrefetchingLoader(torch.utils.data.DataLoader(_FailsAt(-1), batch_size=2), 2, "cpu"):
        break  # a consumer that stops early: the thread ends, it does not wait on a full queue
    assert threading.active_count() == before
    with pytest.raises(ValueError, match="depth must be >= 1"):
        PrefetchingLoader(loader.loader, 0, "cpu")


def test_forward_plans_cost_the_fewest_padded_tokens():
    """plan_forwards against every split of the sorted batch into runs, on random packed batches."""
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(2, 40), rng.randint(100, 300)]) for _ in range(rng.randint(1, 9))]
        budget, rows = rng.choice([(10**6, 64), (600, 64), (10**6, 3)])
        cost = rng.choice([0, 50, 10**4])
        plan = plan_forwards(lengths, budget, rows, cost)
        assert sorted(i for g in plan for i in g) == list(range(len(lengths)))

        def total(groups):
            return sum(len(g) * max(lengths[i] for i in g) + cost for g in groups)

        def allowed(g):
            return len(g) <= rows and (len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget)

        assert all(allowed(g) for g in plan)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        best = min(total(groups) for cuts in itertools.product([0, 1], repeat=len(order) - 1)
                   for groups in [_runs(order, cuts)] if all(allowed(g) for g in groups))
        assert total(plan) == best
    # a mixed batch: the long samples apart from the short ones
    assert plan_forwards([1000, 20, 1000, 30, 25], 10**5, 64, 100) == [[0, 2], [3, 4, 1]]


def _runs(order, cuts):
    groups, current = [], [order[0]]
    for i, cut in zip(order[1:], cuts):
        if cut:
            groups.append(current)
            current = []
        current.append(i)
    return groups + [current]


def test_training_and_validation_share_one_target_on_the_device(training_inputs, tiny_target):  # noqa: F811
    source, train_keys, val_keys = training_split(online(training_inputs), TRAINING)
    args = dict(world_size=1, rank=0, seed=0, num_workers=0, pin_memory=False, target=TargetSpec(str(tiny_target)),
                source=source)
    loaders = [make_loader(*keys, 256, noise, **args) for keys, noise in ((train_keys, 0.05), (val_keys, 0.0))]
    targets = {id(loader.dataset.target) for loader in loaders}
    assert len(targets) == 1
    next(iter(loaders[1]))
    assert loaders[0].dataset.target.get() is loaders[1].dataset.target.get()
