import csv

import numpy as np
import pytest
import torch
from conftest import hf_backend
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from draftsmith.data.tokenization import read_samples
from draftsmith.extraction.driver import extract_shard
from draftsmith.extraction.hf_backend import HFHiddenStateExtractor
from draftsmith.extraction.shards import MANIFEST
from draftsmith.io import sha256_file
from draftsmith.provenance import model_fingerprint
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.attention import dense_mask, dense_mask_sdpa_forward, flex_attention_trains_on
from draftsmith.training.draft_model import build_draft, load_draft
from draftsmith.training.trainer import TrainingInputError, check_inputs, train_draft
from draftsmith.vocab import build_vocab_map, save_npy, token_frequencies

AUX = [1, 3, 4]
TRAINING = {"draft_layers": 1, "ttt_steps": 2, "ttt_step_loss_decay": 1.0, "lr": 0.003, "epochs": 2,
            "total_seq_length": 256, "scheduler": "none", "warmup_steps": None, "noise_std": 0.0,
            "val_fraction": 0.1, "seed": 0, "resume": True, "gpus": 0}


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
    return {"manifests": manifests, "d2t": str(root / "d2t.npy"), "t2d": str(root / "t2d.npy"), "root": root}


def train(inputs, tiny_target, name, **overrides):
    out = inputs["root"] / name
    train_draft(inputs["manifests"], inputs["d2t"], inputs["t2d"], TargetSpec(str(tiny_target)), {**TRAINING, **overrides},
                str(out / "state"), name, 0, str(out / "config.json"), str(out / "model.safetensors"),
                str(out / "metrics.csv"))
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


def test_resume_continues_from_the_last_finished_epoch(training_inputs, tiny_target):
    _, uninterrupted = train(training_inputs, tiny_target, "uninterrupted", epochs=2)
    out, first_part = train(training_inputs, tiny_target, "resumed", epochs=1)
    checkpoint0 = sha256_file(out / "state" / "checkpoints" / "0" / "model.safetensors")
    _, resumed = train(training_inputs, tiny_target, "resumed", epochs=2)
    assert sha256_file(out / "state" / "checkpoints" / "0" / "model.safetensors") == checkpoint0
    assert resumed[: len(first_part)] == first_part  # epoch 0 was not trained again
    epoch1 = [r for r in resumed if r["epoch"] == "1" and r["split"] == "train"]
    reference = [r for r in uninterrupted if r["epoch"] == "1" and r["split"] == "train"]
    assert epoch1 and int(epoch1[0]["step"]) == int(reference[0]["step"])
    # started from the saved (bf16) state: the first loss of epoch 1 matches the uninterrupted run's
    assert float(epoch1[0]["loss"]) == pytest.approx(float(reference[0]["loss"]), rel=0.05)
    assert float(epoch1[0]["loss"]) < 0.8 * float(first_part[0]["loss"])


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
