import csv
import json
import logging
import random
import shutil

import numpy as np
import pytest
import torch
from conftest import hf_backend
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from draftsmith.data.tokenization import read_samples
from draftsmith.draft_model import build_draft, load_draft
from draftsmith.extraction.driver import extract_shard
from draftsmith.extraction.hf_backend import HFHiddenStateExtractor
from draftsmith.extraction.shards import MANIFEST
from draftsmith.io import read_json, sha256_file
from draftsmith.provenance import model_fingerprint
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.attention import dense_mask, dense_mask_sdpa_forward, flex_attention_trains_on
from draftsmith.training.trainer import TrainingInputError, check_inputs, train_draft
from draftsmith.vocab import build_vocab_map, save_npy, token_frequencies
from perf import training_throughput

AUX = [1, 3, 4]
TRAINING = {"draft_layers": 1, "ttt_steps": 2, "ttt_step_loss_decay": 1.0, "lr": 0.003, "epochs": 2,
            "total_seq_length": 256, "scheduler": "none", "warmup_steps": None, "noise_std": 0.0, "tf32": True,
            "val_fraction": 0.1, "data_fraction": 1.0, "seed": 0, "resume": True, "gpus": 0}


def test_dense_mask_sdpa_matches_flex_attention_forward_over_ttt_steps():
    from speculators.models.eagle3.attention import create_combined_mask_mod, extend_mask_for_draft_tokens

    torch.manual_seed(0)
    total = 256
    lengths = torch.tensor([100, 70, 50])  # three packed documents and 36 padding positions
    block_mask = create_block_mask(create_combined_mask_mod(lengths, total), None, None, total, total, device="cpu")
    for step in range(3):
        kv_len = total * (step + 1)
        assert block_mask.seq_lengths == (total, kv_len)
        q = torch.randn(1, 4, total, 16)
        k, v = torch.randn(1, 2, kv_len, 16), torch.randn(1, 2, kv_len, 16)
        reference = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, scale=0.25).transpose(1, 2)
        ours, _ = dense_mask_sdpa_forward(None, q, k, v, block_mask, scaling=0.25)
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)
        block_mask = extend_mask_for_draft_tokens(block_mask)
    mask = dense_mask(block_mask)
    assert mask[120, 120] and mask[120, 100] and not mask[120, 99]  # document 2 sees only itself
    assert mask[120, 120 + 3 * total] and not mask[120, 119 + 3 * total]  # draft tokens: the diagonal only


def test_the_eager_forward_is_speculators_own_forward_unwrapped(training_inputs, tiny_target):
    """training.compile: attention runs speculators' forward without its torch.compile wrapper: the same function (on
    the CPU, where dynamo is off, both give the same outputs bit for bit)."""
    from speculators.models.eagle3.core import Eagle3DraftModel

    from draftsmith.training.attention import eager_forward
    from draftsmith.training.trainer import use_cpu_attention

    unwrapped = eager_forward(Eagle3DraftModel.forward)
    assert unwrapped is not Eagle3DraftModel.forward and unwrapped.__code__.co_name == "forward"
    assert "torch.compile" not in repr(unwrapped) and unwrapped.__module__ == Eagle3DraftModel.__module__
    d2t = torch.from_numpy(np.load(training_inputs["d2t"]))
    t2d = torch.from_numpy(np.load(training_inputs["t2d"]))
    draft = build_draft(TargetSpec(str(tiny_target)), d2t, t2d, 1, AUX)
    use_cpu_attention(draft)
    from draftsmith.training.loader import make_loader, training_split

    _, (files, lengths), _ = training_split(training_inputs["manifests"], TRAINING)
    batch = next(iter(make_loader(files, lengths, 256, 0.0, world_size=1, rank=0, seed=0, num_workers=0,
                                  pin_memory=False)))
    disabled = torch._dynamo.config.disable
    torch._dynamo.config.disable = True
    try:
        with torch.no_grad():
            _, wrapped_loss, _ = draft(**batch, ttt_steps=2)
            _, eager_loss, _ = unwrapped(draft, **batch, ttt_steps=2)
    finally:
        torch._dynamo.config.disable = disabled
    assert torch.equal(wrapped_loss, eager_loss)


def test_flex_attention_backward_probe_reflects_the_device():
    assert flex_attention_trains_on(torch.device("cpu")) is False  # "FlexAttention does not support backward on CPU"


@pytest.fixture(scope="module")
def training_inputs(tiny_target, tiny_samples, tmp_path_factory):
    root = tmp_path_factory.mktemp("train_inputs")
    samples = read_samples(tiny_samples)
    extractor = HFHiddenStateExtractor(str(tiny_target), AUX, device="cpu", dtype="float32")
    manifests = []
    for shard in range(2):
        extract_shard(samples, sha256_file(tiny_samples), shard, 2, root / f"shard_{shard}",
                      hf_backend(tiny_target, AUX, extractor, 1024, 8), model_fingerprint(tiny_target))
        manifests.append(str(root / f"shard_{shard}" / MANIFEST))
    d2t, t2d = build_vocab_map(token_frequencies(tiny_samples), 256, 512)
    save_npy(root / "d2t.npy", d2t)
    save_npy(root / "t2d.npy", t2d)
    return {"manifests": manifests, "d2t": str(root / "d2t.npy"), "t2d": str(root / "t2d.npy"), "root": root,
            "samples": str(tiny_samples)}


def train(inputs, tiny_target, name, states=None, **overrides):
    """Train on `states` (a hidden-state source; default: the shards of `inputs`); the metric rows."""
    out = inputs["root"] / name
    train_draft(states or inputs["manifests"], inputs["d2t"], inputs["t2d"], TargetSpec(str(tiny_target)), {**TRAINING, **overrides},
                str(out / "state"), name, 0, str(out / "config.json"), str(out / "model.safetensors"),
                str(out / "metrics.csv"), str(out / "training_data.json"))
    with open(out / "metrics.csv") as f:
        return out, list(csv.DictReader(f))


def test_target_logits_seen_by_the_trainer_equal_the_targets_own(training_inputs, tiny_target):
    """The last stored layer is post-norm, so verifier_lm_head(states) == the target's logits on the draft vocab."""
    from transformers import AutoModelForCausalLM

    d2t = torch.from_numpy(np.load(training_inputs["d2t"]))
    t2d = torch.from_numpy(np.load(training_inputs["t2d"]))
    draft = build_draft(TargetSpec(str(tiny_target)), d2t, t2d, 1, AUX)
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    shard = training_inputs["manifests"][0].removesuffix(MANIFEST)
    data = torch.load(shard + "data_0.pt", weights_only=True)
    with torch.no_grad():
        seen = draft.verifier_lm_head(data["hidden_states"][-1])
        own = target(data["input_ids"][None]).logits[0][:, t2d]
    torch.testing.assert_close(seen, own, rtol=1e-4, atol=1e-4)


def test_training_lowers_the_loss_and_the_checkpoint_reloads(training_inputs, tiny_target):
    out, rows = train(training_inputs, tiny_target, "full", epochs=3, scheduler="linear")
    train_rows = [r for r in rows if r["split"] == "train"]
    first = np.mean([float(r["loss"]) for r in train_rows if r["epoch"] == "0"][:2])
    last = np.mean([float(r["loss"]) for r in train_rows if r["epoch"] == "2"][-2:])
    assert last < 0.7 * first, (first, last)
    assert {r["epoch"] for r in rows if r["split"] == "val"} == {"0", "1", "2"}
    assert [int(r["step"]) for r in train_rows] == list(range(len(train_rows)))
    draft = load_draft(out)
    assert draft.config.eagle_aux_hidden_state_layer_ids == AUX
    reloaded = load_draft(out)
    x = torch.randn(1, 5, 3 * 64)
    assert torch.equal(draft.fc(x), reloaded.fc(x))
    state = draft.state_dict()
    from safetensors.torch import load_file

    saved = load_file(out / "model.safetensors")
    for key in ("fc.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight", "d2t", "t2d"):
        assert torch.equal(state[key], saved[key].to(state[key].dtype)), key


def test_resume_continues_from_the_last_finished_epoch(training_inputs, tiny_target, caplog):
    out, uninterrupted = train(training_inputs, tiny_target, "resumed", epochs=2)
    checkpoint0 = sha256_file(out / "state" / "checkpoints" / "0" / "model.safetensors")
    saved = (out / "state" / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns
    # the state of a job killed during epoch 1: its checkpoint never renamed into place, its metric rows left behind
    shutil.rmtree(out / "state" / "checkpoints" / "1")
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        _, resumed = train(training_inputs, tiny_target, "resumed", epochs=2)
    assert "resuming from the checkpoint of epoch 0" in caplog.text and "afresh" not in caplog.text
    assert sha256_file(out / "state" / "checkpoints" / "0" / "model.safetensors") == checkpoint0
    # not written again (CPU training is deterministic: a retrained epoch 0 would match byte for byte)
    assert (out / "state" / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns == saved
    first_part = [r for r in uninterrupted if r["epoch"] == "0"]
    assert resumed[: len(first_part)] == first_part  # epoch 0 was not trained again
    assert len(resumed) == len(uninterrupted)  # the cut-short epoch's rows were dropped, then written again
    epoch1 = [r for r in resumed if r["epoch"] == "1" and r["split"] == "train"]
    reference = [r for r in uninterrupted if r["epoch"] == "1" and r["split"] == "train"]
    assert epoch1 and int(epoch1[0]["step"]) == int(reference[0]["step"])
    # started from the saved state: the first loss of epoch 1 matches the uninterrupted run's (exactly: see
    # test_resume_after_a_kill_reproduces_the_uninterrupted_run_bit_for_bit)
    assert float(epoch1[0]["loss"]) == float(reference[0]["loss"])
    assert float(epoch1[0]["loss"]) < 0.8 * float(first_part[0]["loss"])


def without_wall(rows):
    return [{k: v for k, v in r.items() if k != "wall"} for r in rows]


@pytest.mark.parametrize("noise_std,killed_after", [(0.05, 1), (0.0, 0)])
def test_resume_after_a_kill_reproduces_the_uninterrupted_run_bit_for_bit(training_inputs, tiny_target, caplog, noise_std,
                                                                          killed_after):
    """Killed after an epoch of 3 and resumed: the same draft, optimizer state and metric rows as the uninterrupted run
    (the epochs have 12, 11 and 11 steps; the linear schedule's learning rate changes every step)."""
    from safetensors.torch import load_file

    name = f"exact_{noise_std}"
    settings = dict(epochs=3, scheduler="linear", noise_std=noise_std)
    out, uninterrupted = train(training_inputs, tiny_target, name, **settings)
    checkpoints = out / "state" / "checkpoints"
    served = (out / "model.safetensors").read_bytes()
    last = training_inputs["root"] / f"{name}_last_epoch"
    shutil.copytree(checkpoints / "2", last)
    # the state of a job killed during the next epoch: later checkpoints gone, the cut-short epoch's metric rows left
    for epoch in range(killed_after + 1, 3):
        shutil.rmtree(checkpoints / str(epoch))
    # a new process starts with other global RNG states than the killed one had
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        _, resumed = train(training_inputs, tiny_target, name, **settings)
    assert f"resuming from the checkpoint of epoch {killed_after}" in caplog.text and "afresh" not in caplog.text
    assert (out / "model.safetensors").read_bytes() == served  # the exported draft, byte for byte
    assert without_wall(resumed) == without_wall(uninterrupted)  # the resumed epochs: the same steps, lr, losses
    for fname in ("resume/model.safetensors", "model.safetensors"):
        ours, reference = load_file(checkpoints / "2" / fname), load_file(last / fname)
        assert ours.keys() == reference.keys() and ours
        assert all(torch.equal(ours[k], reference[k]) and ours[k].dtype == reference[k].dtype for k in ours), fname
    assert load_file(last / "resume" / "model.safetensors")["fc.weight"].dtype == torch.float32
    assert load_file(last / "model.safetensors")["fc.weight"].dtype == torch.bfloat16  # the served draft, as before
    opt, reference = (torch.load(d / "optimizer_state_dict.pt", weights_only=True) for d in (checkpoints / "2", last))
    assert opt["param_groups"] == reference["param_groups"] and opt["state"].keys() == reference["state"].keys()
    for key, state in reference["state"].items():
        assert state["exp_avg"].dtype == torch.float32
        assert all(torch.equal(opt["state"][key][k], v) for k, v in state.items()), key


def test_noise_of_an_epoch_does_not_depend_on_earlier_epochs_or_workers(training_inputs):
    """The noise a sample gets in epoch 1 is the same whether epoch 0 ran before it in the same persistent DataLoader
    workers (an uninterrupted run on a GPU host) or not (a resumed run), and in the main process or in a worker."""
    from draftsmith.training.loader import make_loader, training_split

    _, (files, lengths), _ = training_split(training_inputs["manifests"], TRAINING)
    args = dict(world_size=1, rank=0, seed=0, pin_memory=False)

    def epoch(loader, n):
        loader.batch_sampler.set_epoch(n)
        return [batch["hidden_states"] for batch in loader]

    uninterrupted = make_loader(files, lengths, 256, 0.05, num_workers=2, **args)
    epochs = [epoch(uninterrupted, n) for n in range(2)]
    torch.manual_seed(12345)
    resumed = epoch(make_loader(files, lengths, 256, 0.05, num_workers=0, **args), 1)
    assert len(resumed) == len(epochs[1]) and all(torch.equal(a, b) for a, b in zip(resumed, epochs[1]))
    clean = [epoch(make_loader(files, lengths, 256, 0.0, num_workers=0, **args), n) for n in range(2)]
    noise = [[a - b for a, b in zip(noisy, plain)] for noisy, plain in zip(epochs, clean)]
    assert all(0 < n.abs().max() <= 0.05 for e in noise for n in e)  # uniform in [-std, std)
    dataset = uninterrupted.dataset  # keyed by (epoch, sample index): new noise each epoch, the same on every load
    assert not torch.equal(dataset[(0, 3)]["hidden_states"], dataset[(1, 3)]["hidden_states"])
    assert torch.equal(dataset[(1, 3)]["hidden_states"], dataset[(1, 3)]["hidden_states"])


@pytest.mark.parametrize("written_by", ["older_draftsmith", "cuda"])
def test_a_checkpoint_that_cannot_resume_exactly_trains_afresh(finished_run, training_inputs, tiny_target, caplog,
                                                              written_by):
    old, _ = finished_run
    state = training_inputs["root"] / f"inexact_{written_by}" / "state"
    shutil.copytree(old, state.parent)
    resume = state / "checkpoints" / "0" / "resume"
    if written_by == "older_draftsmith":  # bfloat16 weights and optimizer state, no RNG state
        shutil.rmtree(resume)
        expected = ("the checkpoint of epoch 0 has no exact resume state (an older draftsmith wrote it: bfloat16 weights "
                    "and optimizer state, no RNG state), so resuming would not reproduce an uninterrupted run: starting afresh")
    else:
        marker = read_json(resume / "resume.json")
        (resume / "resume.json").write_text(json.dumps({**marker, "device_type": "cuda"}))
        expected = ("the checkpoint of epoch 0 was written training on cuda, this run trains on cpu: the remaining epochs "
                    "would not reproduce an uninterrupted run: starting afresh")
    saved = (state / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        train(training_inputs, tiny_target, f"inexact_{written_by}", epochs=1)
    assert expected in caplog.text and "resuming from" not in caplog.text
    assert (state / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns > saved  # epoch 0 trained again
    assert (resume / "resume.json").exists() and read_json(resume / "resume.json")["device_type"] == "cpu"
    assert sha256_file(state.parent / "model.safetensors") == sha256_file(old / "model.safetensors")


@pytest.fixture(scope="module")
def finished_run(training_inputs, tiny_target):
    """A finished one-epoch run; each test below re-runs training on a copy of its state."""
    return train(training_inputs, tiny_target, "finished", epochs=1)


def rerun(finished_run, inputs, tiny_target, name, caplog, **overrides):
    shutil.copytree(finished_run[0], inputs["root"] / name)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        out, rows = train(inputs, tiny_target, name, epochs=1, **overrides)
    return out, rows, caplog.text


def test_rerun_on_the_same_inputs_resumes_without_training(finished_run, training_inputs, tiny_target, caplog):
    old, old_rows = finished_run
    out, rows, text = rerun(finished_run, training_inputs, tiny_target, "same", caplog)
    assert "resuming from the checkpoint of epoch 0" in text and "afresh" not in text
    assert rows == old_rows  # no epoch was trained again
    assert sha256_file(out / "model.safetensors") == sha256_file(old / "model.safetensors")
    checkpoint = "state/checkpoints/0/model.safetensors"
    assert (out / checkpoint).stat().st_mtime_ns == (old / checkpoint).stat().st_mtime_ns  # copied, not rewritten


@pytest.mark.parametrize("key,value", [("lr", 0.01), ("seed", 1)])
def test_changed_training_parameters_train_afresh(finished_run, training_inputs, tiny_target, caplog, key, value):
    old, _ = finished_run
    out, rows, text = rerun(finished_run, training_inputs, tiny_target, f"changed_{key}", caplog, **{key: value})
    assert f"training inputs changed (training.{key}): starting afresh" in text
    assert "resuming" not in text
    assert sha256_file(out / "model.safetensors") != sha256_file(old / "model.safetensors")
    assert read_json(out / "state" / "fingerprint.json")["training"][key] == value
    if key == "lr":
        assert {float(r["lr"]) for r in rows if r["split"] == "train"} == {value}


@pytest.mark.parametrize("change", ["shards", "vocab"])
def test_changed_shards_or_vocab_map_train_afresh(finished_run, training_inputs, tiny_target, caplog, change):
    old, _ = finished_run
    inputs = dict(training_inputs)
    if change == "shards":
        inputs["manifests"] = training_inputs["manifests"][:1]
        changed = "shards"
    else:  # a vocab map of the same size over other tokens, as another dataset's frequencies would give
        d2t, t2d = build_vocab_map({t: 1 for t in range(512)}, 256, 512)
        inputs["d2t"], inputs["t2d"] = (str(training_inputs["root"] / f"other_{n}.npy") for n in ("d2t", "t2d"))
        save_npy(inputs["d2t"], d2t)
        save_npy(inputs["t2d"], t2d)
        changed = "d2t, t2d"
    out, rows, text = rerun(finished_run, inputs, tiny_target, f"changed_{change}", caplog)
    assert f"training inputs changed ({changed}): starting afresh" in text
    assert "resuming" not in text
    assert sha256_file(out / "model.safetensors") != sha256_file(old / "model.safetensors")
    if change == "shards":
        assert f"read from shards from {inputs['manifests'][0]};" in text


def test_a_state_without_fingerprint_trains_afresh(finished_run, training_inputs, tiny_target, caplog):
    old, _ = finished_run
    state = training_inputs["root"] / "no_fingerprint" / "state"
    shutil.copytree(old, state.parent)
    (state / "fingerprint.json").unlink(missing_ok=True)  # a state directory written before fingerprints existed
    saved = (state / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        train(training_inputs, tiny_target, "no_fingerprint", epochs=1)
    assert "has no fingerprint of its training inputs (an older draftsmith wrote it): starting afresh" in caplog.text
    assert "resuming" not in caplog.text
    assert (state / "checkpoints" / "0" / "model.safetensors").stat().st_mtime_ns > saved  # epoch 0 trained again
    assert read_json(state / "fingerprint.json") == read_json(old / "state" / "fingerprint.json")


def test_every_validation_predicts_the_chain_acceptance_length(training_inputs, tiny_target, caplog):
    """speculators' full_acc_i is cumulative (steps 0..i all right), so each validation row of metrics.csv carries
    1 + full_acc_0 + full_acc_1, its log line says it, and training_data.json keeps the last validation's."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        # validation in one packed batch (the identity below holds per batch)
        out, rows = train(training_inputs, tiny_target, "predicted", epochs=2, total_seq_length=1024)
    val = [r for r in rows if r["split"] == "val"]
    assert [r["epoch"] for r in val] == ["0", "1"]
    assert all(r["predicted_acceptance_length"] == "" for r in rows if r["split"] == "train")
    for r in val:
        accs = [float(r[f"full_acc_{i}"]) for i in range(TRAINING["ttt_steps"])]
        predicted = float(r["predicted_acceptance_length"])
        assert predicted == pytest.approx(1 + sum(accs)) and 1 < predicted <= 1 + TRAINING["ttt_steps"]
        assert (f"epoch {r['epoch']} validation: predicted acceptance length {predicted:.3f} tokens per drafted round "
                f"(1 + full accuracies {accs[0]:.3f} + {accs[1]:.3f}); loss_0=") in caplog.text
        # cumulative, as read in speculators' compute_accuracy: full_acc_1 = full_acc_0 x cond_acc_1 (one batch here)
        assert accs[1] == pytest.approx(accs[0] * float(r["cond_acc_1"]), rel=0.02)
    assert float(val[-1]["full_acc_0"]) > 0  # the trained draft predicts something
    last = read_json(out / "training_data.json")["validation"]
    assert last["epoch"] == 1 and last["step"] == int(val[-1]["step"])
    assert last["full_acc"] == [float(val[-1][f"full_acc_{i}"]) for i in range(TRAINING["ttt_steps"])]
    assert last["cond_acc"] == [float(val[-1][f"cond_acc_{i}"]) for i in range(TRAINING["ttt_steps"])]
    assert last["predicted_acceptance_length"] == float(val[-1]["predicted_acceptance_length"])


def test_the_log_says_when_the_first_optimizer_step_finished(training_inputs, tiny_target, caplog):
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        train(training_inputs, tiny_target, "first_step", epochs=1)
    assert caplog.text.count("first optimizer step done") == 1
    assert "torch.compile: " in caplog.text and " compiled (" in caplog.text


def test_a_resumed_run_brings_an_older_metrics_csv_to_todays_columns(finished_run, training_inputs, tiny_target,
                                                                      caplog):
    """A state whose metrics.csv an older draftsmith wrote (no predicted_acceptance_length): resuming keeps its rows
    and gives its validation rows the prediction, instead of appending rows under another header."""
    old, old_rows = finished_run
    name = "older_metrics"
    shutil.copytree(old, training_inputs["root"] / name)
    state_metrics = training_inputs["root"] / name / "state" / "metrics.csv"
    columns = [c for c in old_rows[0] if c != "predicted_acceptance_length"]
    with open(state_metrics, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(old_rows)
    with caplog.at_level(logging.INFO, logger="draftsmith.training"):
        _, rows = train(training_inputs, tiny_target, name, epochs=1)
    assert "resuming from the checkpoint of epoch 0" in caplog.text
    assert list(rows[0]) == list(old_rows[0])
    assert [{k: v for k, v in r.items() if k != "predicted_acceptance_length"} for r in rows] == [
        {k: v for k, v in r.items() if k != "predicted_acceptance_length"} for r in old_rows]
    for r, o in zip(rows, old_rows):
        assert (float(r["predicted_acceptance_length"]) == pytest.approx(float(o["predicted_acceptance_length"]))
                if o["split"] == "val" else r["predicted_acceptance_length"] == "")


def test_mismatched_inputs_are_refused(training_inputs, tiny_target, tmp_path):
    d2t = torch.from_numpy(np.load(training_inputs["d2t"]))
    t2d = torch.from_numpy(np.load(training_inputs["t2d"]))
    with pytest.raises(TrainingInputError, match="no shard manifests"):
        check_inputs([], d2t, t2d, TargetSpec(str(tiny_target)))
    with pytest.raises(TrainingInputError, match="t2d marks 256 tokens but d2t has 255"):
        check_inputs(training_inputs["manifests"], d2t[:-1], t2d, TargetSpec(str(tiny_target)))
    with pytest.raises(TrainingInputError, match="t2d covers 511 tokens"):
        check_inputs(training_inputs["manifests"], d2t, t2d[:-1], TargetSpec(str(tiny_target)))
    import json
    import shutil

    other = tmp_path / "other_target"
    shutil.copytree(tiny_target, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(TrainingInputError, match="different target model"):
        check_inputs(training_inputs["manifests"], d2t, t2d, TargetSpec(str(other)))


def test_data_fraction_trains_on_a_seeded_subset_validated_on_the_same_samples(training_inputs):
    from draftsmith.training.loader import training_split
    from draftsmith.training.trainer import data_summary

    full = training_split(training_inputs["manifests"], {**TRAINING, "data_fraction": 1.0})
    half = training_split(training_inputs["manifests"], {**TRAINING, "data_fraction": 0.5})
    assert half[2] == full[2]  # the same validation files and lengths
    assert set(half[1][0]) < set(full[1][0]) and len(half[1][0]) == round(len(full[1][0]) / 2)
    assert training_split(training_inputs["manifests"], {**TRAINING, "data_fraction": 0.5})[1:] == half[1:]
    summary = data_summary(training_inputs["manifests"], {**TRAINING, "data_fraction": 0.5})
    assert summary["train_samples"] == len(half[1][0]) and summary["train_tokens"] == sum(half[1][1])


def test_training_throughput_profile_covers_steady_steps_of_a_real_run(training_inputs, tiny_target, tmp_path):
    """perf.training_throughput's profile_steps around a real train_draft run (CPU: the SDPA stand-in): it
    records the steps it names, inside the run, and writes the ops that took their time."""
    args = {"states": {"mode": "offline", "paths": training_inputs["manifests"]}, "d2t": training_inputs["d2t"], "t2d": training_inputs["t2d"],
            "target": TargetSpec(str(tiny_target)).to_dict(), "variant": "profiled", "gpus": 0, "num_workers": 0,
            "training": {**TRAINING, "total_seq_length": 128, "resume": False}, "state_dir": str(tmp_path / "state")}
    summary = training_throughput.profile_steps(training_throughput.run_training, args, tmp_path / "profile.txt", wait=2, active=3)
    text = (tmp_path / "profile.txt").read_text()
    assert text.startswith("3 training steps of draftsmith's train_draft after 3:")
    assert summary["steps"] == 3 and 0 < summary["wall_s"] < 60
    assert summary["device_busy_s"] == 0  # no CUDA kernels on a CPU run
    assert "aten::mm" in text or "aten::addmm" in text  # the draft's linear layers ran inside the window
    with pytest.raises(RuntimeError, match="the profile needs"):
        training_throughput.profile_steps(training_throughput.run_training, {**args, "state_dir": str(tmp_path / "again")}, tmp_path / "p2.txt",
                             wait=500, active=3)


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_setting_holds_over_the_training_steps_and_is_restored(training_inputs, tiny_target, tf32):
    """training.tf32 sets torch's TF32 matmul flag for the Trainer's steps (whatever it was before), puts the old
    value back after, and is part of the training state's fingerprint."""
    seen = []

    class Probe(logging.Handler):
        def emit(self, record):
            if isinstance(record.msg, dict) and "train" in record.msg:
                seen.append(torch.backends.cuda.matmul.allow_tf32)

    probe, metrics = Probe(), logging.getLogger("speculators.metrics")
    metrics.addHandler(probe)
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    try:
        out, _ = train(training_inputs, tiny_target, f"tf32_{tf32}", epochs=1, tf32=tf32)
        assert torch.backends.cuda.matmul.allow_tf32 is (not tf32)
    finally:
        metrics.removeHandler(probe)
        torch.backends.cuda.matmul.allow_tf32 = False
    assert seen and set(seen) == {tf32}
    assert read_json(out / "state" / "fingerprint.json")["training"]["tf32"] is tf32
