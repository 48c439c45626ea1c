import json
import re

import pytest
import torch
from conftest import hf_backend

from draftsmith.data.tokenization import read_samples
from draftsmith.extraction.driver import extract_shard
from draftsmith.extraction.hf_backend import HFHiddenStateExtractor
from draftsmith.extraction.shards import JOURNAL, MANIFEST, ShardError, shard_files, validate_shard
from draftsmith.io import sha256_file
from draftsmith.provenance import model_fingerprint

AUX = [1, 3, 4]


class Interrupted(RuntimeError):
    pass


class FaultyExtractor(HFHiddenStateExtractor):
    """On its n-th batch either dies, like a job killed mid-shard (`kill`), or returns states with a NaN (`nan`: an
    fp16 overflow, a broken kernel)."""

    def __init__(self, *args, fault_at: int, fault: str = "kill", **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.fault_at, self.fault = 0, fault_at, fault

    def forward(self, batch_ids):
        self.calls += 1
        if self.calls == self.fault_at and self.fault == "kill":
            raise Interrupted("simulated kill")
        states = super().forward(batch_ids)
        if self.calls == self.fault_at and self.fault == "nan":
            states = states.clone()
            states[2, 0, 1, 3] = float("nan")  # the third layer, the first row, its second token
        return states


def run(tiny_target, tiny_samples, shard_dir, extractor=None, shard=0, num_shards=2):
    samples = read_samples(tiny_samples)
    extractor = extractor or HFHiddenStateExtractor(str(tiny_target), AUX, device="cpu", dtype="float32")
    return extract_shard(samples, sha256_file(tiny_samples), shard, num_shards, shard_dir,
                         hf_backend(tiny_target, AUX, extractor), model_info=model_fingerprint(tiny_target))


@pytest.fixture(scope="module")
def shard(tiny_target, tiny_samples, tmp_path_factory):
    shard_dir = tmp_path_factory.mktemp("shard") / "shard_0"
    run(tiny_target, tiny_samples, shard_dir)
    return shard_dir


def test_shard_is_speculators_format_and_matches_its_manifest(shard, tiny_samples):
    samples = read_samples(tiny_samples)
    manifest = validate_shard(shard, samples, deep=True)
    assert manifest["num_samples"] == len(range(0, len(samples["input_ids"]), 2))
    assert manifest["layer_ids"] == AUX + [-1] and manifest["format"] == "speculators-data-v1"
    assert sorted(p.name for p in shard.iterdir()) == sorted([MANIFEST] + [e["file"] for e in manifest["samples"]])
    entry = manifest["samples"][1]
    data = torch.load(shard / entry["file"], weights_only=True)
    assert data["input_ids"].tolist() == samples["input_ids"][entry["index"]]
    assert data["loss_mask"].tolist() == samples["loss_mask"][entry["index"]]
    assert len(data["hidden_states"]) == 4 and data["hidden_states"][0].shape == (entry["num_tokens"], 64)
    assert shard_files([shard / MANIFEST]) == [str(shard / e["file"]) for e in manifest["samples"]]


def test_speculators_dataset_reads_the_shard(shard):
    from speculators.train.data import Eagle3SampleFileDataset

    files = shard_files([shard / MANIFEST])
    item = Eagle3SampleFileDataset(max_len=512, file_list=files)[0]
    n = json.loads((shard / MANIFEST).read_text())["samples"][0]["num_tokens"]
    assert item["hidden_states"].shape == (n - 1, 3 * 64)
    assert item["verifier_last_hidden_states"].shape == (n - 1, 64)


def test_interrupted_shard_resumes_and_is_byte_identical(tiny_target, tiny_samples, shard, tmp_path):
    shard_dir = tmp_path / "shard_0"
    failing = FaultyExtractor(str(tiny_target), AUX, device="cpu", dtype="float32", fault_at=3)
    with pytest.raises(Interrupted):
        run(tiny_target, tiny_samples, shard_dir, extractor=failing)
    assert not (shard_dir / MANIFEST).exists() and (shard_dir / JOURNAL).exists()
    written = {p.name for p in shard_dir.glob("data_*.pt")}
    assert written, "the first batches were written before the kill"
    manifest = run(tiny_target, tiny_samples, shard_dir)
    assert manifest["resumed_samples"] == len(written)
    reference = json.loads((shard / MANIFEST).read_text())
    assert [(e["file"], e["sha256"]) for e in manifest["samples"]] == [(e["file"], e["sha256"]) for e in reference["samples"]]
    assert not (shard_dir / JOURNAL).exists()


def test_a_shard_started_with_other_inputs_starts_over(tiny_target, tiny_samples, tmp_path):
    shard_dir = tmp_path / "shard_1"
    failing = FaultyExtractor(str(tiny_target), AUX, device="cpu", dtype="float32", fault_at=2)
    with pytest.raises(Interrupted):
        run(tiny_target, tiny_samples, shard_dir, extractor=failing, shard=1, num_shards=2)
    manifest = run(tiny_target, tiny_samples, shard_dir, shard=1, num_shards=3)
    assert manifest["resumed_samples"] == 0 and manifest["num_shards"] == 3
    assert {p.name for p in shard_dir.glob("data_*.pt")} == {e["file"] for e in manifest["samples"]}


@pytest.mark.parametrize("fault, check", [
    ("flip_byte", "checksum"),
    ("delete", "missing file"),
    ("nan", "finite"),
    ("inf", "finite"),
    ("zeros", "non-zero"),
    ("wrong_ids", "token ids"),
])
def test_validator_names_shard_file_and_check(shard, tiny_samples, tmp_path, fault, check):
    import shutil

    bad = tmp_path / "shard_0"
    shutil.copytree(shard, bad)
    manifest = json.loads((bad / MANIFEST).read_text())
    entry = manifest["samples"][2]
    path = bad / entry["file"]
    if fault == "flip_byte":
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif fault == "delete":
        path.unlink()
    else:
        data = torch.load(path, weights_only=True)
        if fault in ("nan", "inf"):
            data["hidden_states"][1][3, 5] = float(fault)
        elif fault == "zeros":
            data["hidden_states"][0].zero_()
        else:
            data["input_ids"][0] += 1
        torch.save(data, path)
        entry["sha256"] = sha256_file(path)  # consistent checksum: only the deep checks can tell
        (bad / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as e:
        validate_shard(bad, read_samples(tiny_samples), deep=True)
    assert str(bad) in str(e.value) and entry["file"] in str(e.value) and check in str(e.value)


def test_states_are_checked_before_they_are_written(tiny_target, tiny_samples, tmp_path):
    """Extraction checks each sample's states in memory (not by reading the files back): a NaN stops the shard,
    naming the file, the sample and the check, and no manifest is written; the samples written before it are kept."""
    shard_dir = tmp_path / "shard_0"
    with pytest.raises(ShardError) as failed:
        run(tiny_target, tiny_samples, shard_dir,
            extractor=FaultyExtractor(str(tiny_target), AUX, device="cpu", dtype="float32", fault_at=2,
                                      fault="nan"))
    message = str(failed.value)
    assert str(shard_dir) in message and "finite: hidden_states[2] contains NaN" in message
    assert re.search(r"data_\d+\.pt \(sample '[^']+'\)", message)
    assert not (shard_dir / MANIFEST).exists()
    journal = (shard_dir / JOURNAL).read_text().splitlines()[1:]
    assert journal and all(sha256_file(shard_dir / json.loads(line)["file"]) == json.loads(line)["sha256"]
                           for line in journal)
    assert not (shard_dir / re.search(r"(data_\d+\.pt)", message).group(1)).exists()


