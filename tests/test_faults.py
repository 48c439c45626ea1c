"""Fault injection on the real workflow: kills, full disks, corrupt and malformed inputs.

Each test works on a copy of the session pipeline's inputs, so it never disturbs other tests.
docs/RELIABILITY.md lists every fault tried here and what happens.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SNAKEMAKE, copy_inputs, snakemake, write_config
from test_training import TRAINING, training_inputs  # noqa: F401 - a module fixture: two small shards, a vocab map

from draftsmith.io import sha256_file

SHARD = "results/shards/synthetic/shard_0"


def manifest_target(workdir: Path) -> str:
    return str(workdir / SHARD / "manifest.json")


def journal_entries(shard: Path) -> list[dict]:
    lines = (shard / "progress.jsonl").read_text().splitlines()[1:]
    return [json.loads(line) for line in lines if line.strip()]


def test_sigkill_mid_shard_then_rerun_resumes_byte_identical(pipeline_run, tmp_path):
    # one sample per batch, so the shard takes long enough to be killed half-way
    workdir = copy_inputs(pipeline_run, tmp_path, {"extraction": {"max_batch_size": 1}})
    shard = workdir / SHARD
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile",
           str(workdir / "config.yaml"), "--cores", "1", f"{SHARD}/manifest.json"]  # as Snakemake spells it
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if (shard / "progress.jsonl").exists() and len(journal_entries(shard)) >= 10:
            break
        if proc.poll() is not None:
            pytest.fail("extraction finished before it could be killed")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # snakemake and its job, mid-shard
    proc.wait()
    assert not (shard / "manifest.json").exists(), "a killed job must leave nothing that looks finished"
    done = journal_entries(shard)
    assert len(done) >= 10
    for entry in done:
        assert sha256_file(shard / entry["file"]) == entry["sha256"]

    snakemake(workdir, "--unlock")  # a killed Snakemake leaves its lock, as after a power loss
    snakemake(workdir, manifest_target(workdir), "--cores", "1")
    manifest = json.loads((shard / "manifest.json").read_text())
    assert manifest["resumed_samples"] >= len(done) and manifest["resumed_samples"] < manifest["num_samples"]
    resumed = [(e["file"], e["sha256"]) for e in manifest["samples"]]

    shutil.move(shard, tmp_path / "resumed_shard")  # now the same shard without interruption
    snakemake(workdir, manifest_target(workdir), "--cores", "1")
    fresh = json.loads((shard / "manifest.json").read_text())
    assert fresh["resumed_samples"] == 0
    assert [(e["file"], e["sha256"]) for e in fresh["samples"]] == resumed


def test_disk_full_keeps_completed_samples_and_logs_the_error(pipeline_run, tmp_path):
    workdir = copy_inputs(pipeline_run, tmp_path, {"extraction": {"max_batch_size": 4}})
    shard = workdir / SHARD
    shard.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(shard)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.strip()}")
    try:
        proc = snakemake(workdir, manifest_target(workdir), check=False)
        assert proc.returncode != 0
        log = (workdir / "results" / "logs" / "extract_hidden_states" / "synthetic" / "shard_0.log").read_text()
        assert "No space left on device" in log
        done = journal_entries(shard)
        assert done, "samples written before the disk filled are kept"
        for entry in done:
            assert sha256_file(shard / entry["file"]) == entry["sha256"]
        assert not (shard / "manifest.json").exists()
        kept = tmp_path / "kept"
        shutil.copytree(shard, kept)
    finally:
        subprocess.run(["umount", str(shard)], check=True)
    shutil.rmtree(shard)
    shutil.copytree(kept, shard)  # the same files on a disk with room again
    snakemake(workdir, manifest_target(workdir))
    manifest = json.loads((shard / "manifest.json").read_text())
    assert manifest["resumed_samples"] >= len(done)


@pytest.mark.parametrize("fault", ["flip_byte", "truncate"])
def test_corrupt_shard_is_refused_by_validate_and_training(pipeline_run, tmp_path, fault):
    workdir = copy_inputs(pipeline_run, tmp_path)
    for sub in ("shards", "vocab"):
        shutil.copytree(pipeline_run / "results" / sub, workdir / "results" / sub)
    manifest = json.loads((workdir / SHARD / "manifest.json").read_text())
    victim = workdir / SHARD / manifest["samples"][3]["file"]
    raw = victim.read_bytes()
    victim.write_bytes(raw[: len(raw) // 2] if fault == "truncate" else raw[:100] + bytes([raw[100] ^ 1]) + raw[101:])

    proc = snakemake(workdir, "validate", check=False)
    assert proc.returncode != 0
    log = (workdir / "results" / "logs" / "validate.log").read_text()
    assert victim.name in log and "checksum" in log

    proc = snakemake(workdir, str(workdir / "results" / "draft" / "default" / "config.json"), check=False)
    assert proc.returncode != 0
    log = (workdir / "results" / "logs" / "train_draft" / "default.log").read_text()
    assert victim.name in log and "checksum" in log
    assert not (workdir / "results" / "draft" / "default" / "config.json").exists()


def test_deleted_shard_is_named_by_validate_and_rebuilt_by_a_plain_rerun(pipeline_run, run_copy, capsys):
    """README's recovery for a corrupt shard: delete the shard directory and re-run `snakemake`."""
    from conftest import jobs_planned

    from draftsmith.cli import main

    workdir = run_copy
    r = workdir / "results"
    noop = snakemake(workdir, "-n")
    assert "Nothing to be done" in noop.stdout + noop.stderr
    draft = sha256_file(r / "draft" / "default" / "model.safetensors")
    shutil.rmtree(workdir / SHARD)

    # the tree lies under the working directory: Snakemake and validate spell it relative to it
    missing = f"{SHARD}: missing: the config implies this shard (rule extract_hidden_states)"
    proc = snakemake(workdir, "validate", check=False)
    assert proc.returncode != 0 and missing in (workdir / "results" / "logs" / "validate.log").read_text()
    assert main(["validate", "--config", str(workdir / "config.yaml")]) == 1
    assert missing in capsys.readouterr().out

    proc = snakemake(workdir)  # the documented recovery
    assert jobs_planned(proc) == {"extract_hidden_states": 1, "train_draft": 1, "benchmark": 1, "report": 1, "all": 1}
    original = json.loads((pipeline_run / SHARD / "manifest.json").read_text())
    rebuilt = json.loads((workdir / SHARD / "manifest.json").read_text())
    assert rebuilt["samples"] == original["samples"]  # hf on the CPU is deterministic: the same files, byte for byte
    # train_draft re-ran on it; training.resume finds the finished last epoch in train_state and exports the same draft
    assert sha256_file(r / "draft" / "default" / "model.safetensors") == draft
    assert (r / "report" / "report.md").stat().st_mtime > (workdir / SHARD / "manifest.json").stat().st_mtime
    snakemake(workdir, "validate")
    assert main(["validate", "--config", str(workdir / "config.yaml")]) == 0
    noop = snakemake(workdir, "-n")
    assert "Nothing to be done" in noop.stdout + noop.stderr


def test_malformed_dataset_fails_with_file_record_and_field(pipeline_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([
        '{"id": "r1", "messages": [{"role": "user", "content": "hi"}]}',
        "{not json",
        '{"id": "r3", "conversations": [{"from": "gpt", "value": "I speak first"}, {"from": "human", "value": "ok"}]}',
        '{"id": "r4", "messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]}',
    ]) + "\n")
    workdir = copy_inputs(pipeline_run, tmp_path / "w")
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["datasets"] = {"broken": {"source": "local", "path": str(bad)}}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    proc = snakemake(workdir, str(workdir / "results" / "prepared" / "broken" / "samples.parquet"), check=False)
    assert proc.returncode != 0
    log = (workdir / "results" / "logs" / "prepare_dataset" / "broken.log").read_text()
    assert "dataset 'broken' has no usable records" in log
    assert f"{bad}: line 2: invalid JSON" in log
    assert f"{bad}: line 4 (id r4): messages[0].content is int" in log
    assert "starts with an assistant turn" in log
    assert ("skipped by reason: {'invalid_json': 1, 'no_assistant_turn': 1, 'non_string_content': 1, "
            "'starts_with_assistant': 1}") in log
    assert not (workdir / "results" / "prepared" / "broken" / "samples.parquet").exists()
    # the counts the troubleshooting table points to outlive the failed job (its stats.json was deleted with it)
    assert not (workdir / "results" / "prepared" / "broken" / "stats.json").exists()
    kept = json.loads((workdir / "results" / "logs" / "prepare_dataset" / "broken.stats.json").read_text())
    assert kept["records_read"] == 4 and kept["records_kept"] == 0 and sum(kept["skipped_by_reason"].values()) == 4


def test_skipped_records_reach_the_console_and_their_counts_outlive_a_failed_job(tiny_target, tmp_path):
    """A dataset with 40 of 200 records skipped exited 0 with nothing on the console: now one console line with the
    counts by reason, and a warning since more than 10% were skipped. A dataset with none usable fails; Snakemake
    deletes its stats.json, and the copy beside the rule's log keeps the counts."""
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    question = [{"role": "user", "content": "hi"}]
    (tmp_path / "mixed.jsonl").write_text("".join(
        json.dumps({"id": f"r{i}", "messages": question if i % 5 == 4 else reply}) + "\n" for i in range(200)))
    (tmp_path / "broken.jsonl").write_text("".join(json.dumps({"messages": question}) + "\n" for _ in range(3)))
    write_config(tmp_path, {"target": {"model": str(tiny_target), "revision": None, "trust_remote_code": False},
                            "datasets": {d: {"source": "local", "path": str(tmp_path / f"{d}.jsonl")}
                                         for d in ("mixed", "broken")}})
    r = tmp_path / "results"
    proc = snakemake(tmp_path, "--keep-going", *(str(r / "prepared" / d / "stats.json") for d in ("mixed", "broken")),
                     check=False)
    assert proc.returncode != 0
    kept_stats = "results/logs/prepare_dataset/mixed.stats.json"  # as Snakemake spells the tree (relative)
    assert (f"prepare_dataset mixed: 40 of 200 records skipped (no_assistant_turn: 40), 160 kept; counts in "
            f"{kept_stats}; each skipped record is named in the rule's log") in proc.stdout
    assert "WARNING: dataset 'mixed': 20% of its records were skipped (more than 10%)" in proc.stdout
    assert json.loads((r / "prepared" / "mixed" / "stats.json").read_text())["records_kept"] == 160
    assert not (r / "prepared" / "broken" / "stats.json").exists()
    broken = json.loads((r / "logs" / "prepare_dataset" / "broken.stats.json").read_text())
    assert broken["skipped_by_reason"] == {"no_assistant_turn": 3} and broken["records_kept"] == 0
    assert "prepare_dataset broken: 3 of 3 records skipped (no_assistant_turn: 3), 0 kept" in proc.stdout


def test_truncated_manifest_fails_naming_the_file_and_the_command_that_rebuilds_the_shard(training_inputs, tiny_target,  # noqa: F811 - the fixture imported above
                                                                                          tmp_path):
    """A manifest cut mid-file (not by draftsmith, which writes it atomically: by a copy, a full disk elsewhere):
    every reader names the file, says it is truncated, and gives the command that really rebuilds the shard."""
    from draftsmith.extraction.shards import ShardError, validate_shard
    from draftsmith.report.load import ReportInputError, load_manifests
    from draftsmith.target_model.spec import TargetSpec
    from draftsmith.training.trainer import train_draft

    shard = tmp_path / "shards" / "synthetic" / "shard_0"
    shutil.copytree(Path(training_inputs["manifests"][0]).parent, shard)
    manifest = shard / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:700])
    expected = [f"{manifest}: truncated or invalid JSON", f"`snakemake --forcerun {manifest}`", f"delete {shard}"]

    out = tmp_path / "draft"
    with pytest.raises(ValueError) as failed:
        train_draft([str(manifest), training_inputs["manifests"][1]], training_inputs["d2t"], training_inputs["t2d"],
                    TargetSpec(str(tiny_target)), TRAINING, str(out / "state"), "default", 0, str(out / "config.json"),
                    str(out / "model.safetensors"), str(out / "metrics.csv"), str(out / "training_data.json"))
    messages = [str(failed.value)]
    with pytest.raises(ShardError) as failed:  # snakemake validate, draftsmith validate / inspect
        validate_shard(shard)
    messages.append(str(failed.value))
    with pytest.raises(ReportInputError) as failed:  # the report
        load_manifests([manifest])
    messages.append(str(failed.value))
    for message in messages:
        assert all(part in message for part in expected), message
    assert not out.exists()


def test_truncated_manifest_stops_the_run_before_any_job_and_forcerun_rebuilds_the_shard(pipeline_run, run_copy):
    """Downstream up to date, one manifest truncated (its mtime now newer than the draft): a plain `snakemake`
    must not start train_draft, which would delete the last good draft and then fail on the manifest."""
    from conftest import jobs_planned

    workdir = run_copy
    r = workdir / "results"
    draft = {name: sha256_file(r / "draft" / "default" / name) for name in ("config.json", "model.safetensors")}
    manifest = workdir / SHARD / "manifest.json"
    original = json.loads(manifest.read_text())
    manifest.write_bytes(manifest.read_bytes()[:1000])

    proc = snakemake(workdir, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    spelled = manifest.relative_to(workdir)  # as Snakemake spells the tree under its working directory
    assert f"{spelled}: truncated or invalid JSON" in output and f"`snakemake --forcerun {spelled}`" in output
    assert "No job was started." in output and "localrule" not in output and "rule train_draft" not in output
    assert {name: sha256_file(r / "draft" / "default" / name) for name in draft} == draft  # the last good draft

    proc = snakemake(workdir, "--forcerun", str(manifest))  # the command the message gives
    assert jobs_planned(proc) == {"extract_hidden_states": 1, "train_draft": 1, "benchmark": 1, "report": 1, "all": 1}
    assert json.loads(manifest.read_text())["samples"] == original["samples"]  # hf on the CPU: the same files
    # hf and training on the CPU are deterministic: the same weights (config.json names this copy's target path)
    assert sha256_file(r / "draft" / "default" / "model.safetensors") == draft["model.safetensors"]
    noop = snakemake(workdir, "-n")
    assert "Nothing to be done" in noop.stdout + noop.stderr


def files_sha256(directory: Path) -> dict[str, str]:
    """Every file below `directory` (a checkpoint holds a resume/ folder) by relative path, with its sha256."""
    return {str(p.relative_to(directory)): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def test_disk_full_while_saving_a_checkpoint_names_the_path_and_keeps_the_last_checkpoint(training_inputs, tiny_target,  # noqa: F811 - the fixture imported above
                                                                                          tmp_path):
    """The training state on a small tmpfs with room for half a checkpoint: torch.save's own error says only
    "enforce fail at inline_container.cc"; the job's error must say "No space left on device" with the path."""
    from draftsmith.target_model.spec import TargetSpec
    from draftsmith.training.trainer import train_draft

    state = tmp_path / "state"
    state.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(state)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {mounted.stderr.strip()}")
    out = tmp_path / "draft"

    def train():
        train_draft(training_inputs["manifests"], training_inputs["d2t"], training_inputs["t2d"], TargetSpec(str(tiny_target)),
                    {**TRAINING, "epochs": 2}, str(state), "default", 0, str(out / "config.json"),
                    str(out / "model.safetensors"), str(out / "metrics.csv"), str(out / "training_data.json"))

    try:
        train()
        checkpoints = state / "checkpoints"
        kept = files_sha256(checkpoints / "0")
        size = sum(p.stat().st_size for p in (checkpoints / "1").rglob("*") if p.is_file())
        shutil.rmtree(checkpoints / "1")  # the state of a job killed during epoch 1
        filler = state / "filler"
        with open(filler, "wb") as f:  # leave room for half of epoch 1's checkpoint
            f.write(bytes((shutil.disk_usage(state).free - size // 2) // 4096 * 4096))

        with pytest.raises(OSError) as full:
            train()
        message = str(full.value)
        assert full.value.errno == errno.ENOSPC and "No space left on device" in message, message
        assert str(checkpoints / ".staging" / "1") in message and "bytes" in message
        # the writer's own error (torch.save's "enforce fail at inline_container.cc", or safetensors' for the weights
        # written first since checkpoints hold full-precision weights too) is kept beside the translation
        assert " are free there (" in message and message.count("No space left on device") >= 1
        assert files_sha256(checkpoints / "0") == kept  # the last checkpoint intact
        assert not (checkpoints / "1").exists() and not (checkpoints / ".staging" / "1").exists()  # no partial save

        filler.unlink()  # room again: the re-run resumes from epoch 0 and finishes
        train()
        assert (checkpoints / "1" / "model.safetensors").exists() and (out / "model.safetensors").exists()
    finally:
        subprocess.run(["umount", str(state)], check=True)
