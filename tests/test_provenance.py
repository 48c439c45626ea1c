"""Provenance by content (issue 47): inputs are known by their bytes, the results tree by one spelling, and
`draftsmith validate` follows a chain of recorded checksums and Snakemake's own plan, printing commands that work.

The pipeline tests share one copy of the session's finished tiny run (tests/conftest.py `pipeline_run`), copied
whole with its .snakemake records and mtimes, and put back what they change; the validate test reruns the few jobs
its printed commands rebuild."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO, SNAKEMAKE, jobs_planned, snakemake

from draftsmith.cli import main
from draftsmith.fingerprints import ContentHashes, results_path

TARGET_LOADERS = {"prepare_dataset", "extract_hidden_states", "vocab_map", "token_freq", "train_draft", "benchmark",
                  "report", "all"}


def edit_in_place(path, keep_mtime=True):
    """Flip the last byte: same size; the old mtime put back (an editor or tool that keeps it)."""
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ----------------------------------------------------------------------------- the content hash cache


def test_the_cache_is_keyed_so_that_no_content_change_hides_behind_size_and_mtime(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"a": 1}\n')
    hashes = ContentHashes(tmp_path)
    first = hashes.sha256(data)
    key = os.path.realpath(data)
    # an entry hashed long after the file's last change is trusted: a bogus digest in it is returned as is
    hashes.entries[key] = {**hashes.entries[key], "sha256": "cached", "hashed_at_ns": time.time_ns() + 10**10}
    assert hashes.sha256(data) == "cached"
    edit_in_place(data)  # same size, same mtime: ctime moved
    changed = hashes.sha256(data)
    assert changed not in (first, "cached")
    # an older mtime (cp -p, rsync -a of another file of the same size)
    other = tmp_path / "other.jsonl"
    other.write_text('{"a": 2}\n')
    os.utime(other, ns=(1, 1))
    shutil.copy2(other, data)
    assert hashes.sha256(data) == ContentHashes().sha256(other) != changed
    # touched or copied without -p: another stamp, the same digest
    os.utime(data)
    assert hashes.sha256(data) == ContentHashes().sha256(other)
    # an entry hashed within MARGIN_NS of the file's last change is not trusted (a write in the same clock tick)
    st = os.stat(data)
    hashes.entries[key] = {**hashes.entries[key], "sha256": "racy", "hashed_at_ns": st.st_ctime_ns + 10**9}
    assert hashes.sha256(data) != "racy"
    hashes.save()
    assert json.loads((tmp_path / ".draftsmith" / "content_hashes.json").read_text())[key]["sha256"] == hashes.sha256(data)


def test_the_results_path_has_one_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "results")
    for spelling in ("results", "./results", str(tmp_path / "results"), "link", "link/../results"):
        assert str(results_path(spelling)) == "results", spelling
    outside = tmp_path.parent / "elsewhere"
    assert results_path(str(outside)) == outside.resolve()
    assert results_path(os.path.relpath(outside)) == outside.resolve()


# ----------------------------------------------------------------------------- smaller items of issue 47


def test_later_user_turns_of_a_regenerate_prompt_are_counted_and_warned(tiny_target, tmp_path, caplog):
    from draftsmith.generation.driver import regenerate
    from draftsmith.generation.prompt_records import regeneration_prompts
    from draftsmith.io import write_jsonl

    raw = tmp_path / "raw.jsonl"
    write_jsonl(raw, [
        {"id": "one", "messages": [{"role": "user", "content": "Say hi."}]},
        {"id": "three", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                                     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"},
                                     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Once more?"}]},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "What is 12 + 7?"}, {"from": "gpt", "value": "19"},
                                             {"from": "human", "value": "And 12 + 8?"}]},
    ])
    with caplog.at_level("WARNING", logger="draftsmith.generation"):
        records = regeneration_prompts({"source": "local", "path": str(raw)}, "local")
        stats = regenerate(records, tiny_target, tmp_path / "out.jsonl", max_new_tokens=2, batch_size=3,
                                 chunk_size=3, show_progress=False)
    assert [len(r["messages"]) for r in records] == [1, 2, 1]  # each prompt: system turns and the first user turn
    assert stats["later_user_turns_dropped"] == 3
    assert f"regenerate: 3 user turns after the first of their record are left out of {raw}" in caplog.text


def test_an_empty_dataset_file_is_named_with_its_path(tmp_path):
    from draftsmith.data.tokenization import prepare_dataset

    empty = tmp_path / "mine.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError) as error:
        prepare_dataset({"source": "local", "path": str(empty)}, None, 64, tmp_path / "s.parquet",
                        tmp_path / "stats.json", name="mine")
    assert str(error.value) == f"dataset 'mine': {empty} holds no records (an empty file or dataset); check datasets.mine"


def test_stage_times_leave_out_the_jobs_of_a_variant_renamed_away(tmp_path):
    from draftsmith.artefacts import job_benchmark_files
    from draftsmith.report.stage_times import stage_times

    for rel, seconds in {"vocab_map.tsv": 2, "train_draft/old.tsv": 100, "train_draft/new.tsv": 7,
                         "extract_hidden_states/d/shard_0.tsv": 3, "extract_hidden_states/d/shard_5.tsv": 50}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"s\tmax_rss\n{seconds}\t1\n")
    config = {"datasets": {"d": {}}, "variants": {"new": {}}, "extraction": {"num_shards": 1}}
    stages = stage_times(tmp_path, job_benchmark_files(config)).set_index("stage")
    assert stages.loc["train_draft", "seconds"] == 7 and stages.loc["train_draft", "jobs"] == 1
    assert stages.loc["extract_hidden_states", "seconds"] == 3 and stages.loc["vocab_map", "seconds"] == 2


# ----------------------------------------------------------------------------- on a copy of the finished tiny run


@pytest.fixture(scope="module")
def copied_run(pipeline_run, tmp_path_factory):
    """The session's finished run, copied whole (its .snakemake records, mtimes), with `results: results`."""
    workdir = tmp_path_factory.mktemp("copied") / "run"
    shutil.copytree(pipeline_run, workdir, symlinks=True)
    shutil.rmtree(workdir / ".snakemake" / "locks", ignore_errors=True)
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    (workdir / "config.yaml").write_text(yaml.safe_dump({**config, "results": "results"}))
    return workdir


def plan(workdir, *args, config="config.yaml") -> set[str]:
    proc = snakemake(workdir, "-n", *args, "--configfile", str(workdir / config))
    return set(jobs_planned(proc))


def write_changed(workdir, name, **sections) -> str:
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    for section, values in sections.items():
        config[section] = {**config[section], **values} if isinstance(values, dict) else values
    (workdir / name).write_text(yaml.safe_dump(config))
    return name


def test_a_copied_or_respelled_tree_keeps_its_records_and_inputs_rerun_by_content(copied_run, tmp_path):
    """One spelling of the results tree: the copy, its absolute spelling, and a config change through either.
    Inputs by content: the built target's files touched re-run nothing; one byte changed with size and mtime kept
    re-runs every rule that loads it."""
    r = copied_run / "results"
    assert plan(copied_run) == set()  # the copied working directory is valid as it is
    write_changed(copied_run, "absolute.yaml", results=str(r))
    assert plan(copied_run, config="absolute.yaml") == set()
    write_changed(copied_run, "lr.yaml", results=str(r), training={"lr": 0.0005})
    assert plan(copied_run, config="lr.yaml") == {"train_draft", "benchmark", "report", "all"}

    target = r / "target"
    backup = tmp_path / "target"
    shutil.copytree(target, backup)  # mtimes kept, to put back
    try:
        for f in target.iterdir():  # `touch results/target/*`: the model's files, not Snakemake's dotfile timestamp
            if not f.name.startswith("."):
                os.utime(f)
        planned = plan(copied_run)
        assert planned == set(), f"touching the target's files planned {sorted(planned)}"
        edit_in_place(target / "model.safetensors")
        assert plan(copied_run) == TARGET_LOADERS
    finally:
        shutil.rmtree(target)
        shutil.copytree(backup, target, symlinks=True)
    assert plan(copied_run) == set()

    # a second working directory on the same (absolute) tree would not see Snakemake's records: refused
    other = tmp_path / "other"
    other.mkdir()
    write_changed(copied_run, "from-other.yaml", results=str(r))
    shutil.copy(copied_run / "from-other.yaml", other / "config.yaml")
    run_json = r / ".draftsmith" / "run.json"
    saved = run_json.read_text()
    try:  # as a run with the absolute spelling records it
        run_json.write_text(json.dumps({**json.loads(saved), "workdir": str(copied_run)}))
        proc = snakemake(other, "validate", check=False)  # a real run (a dry run plans, without the records)
    finally:
        run_json.write_text(saved)
    assert proc.returncode != 0
    assert f"results: {r} was made from the working directory {copied_run}, where Snakemake keeps" in \
        proc.stdout + proc.stderr


def test_a_local_dataset_reruns_its_preparation_by_content_only(copied_run, tmp_path):
    """A raw dataset outside the results tree: touch and cp without -p re-run nothing; an edit keeping size and mtime,
    and another file copied over it with an older mtime (cp -p), re-run prepare_dataset."""
    data = tmp_path / "mine.jsonl"
    shutil.copy2(copied_run / "results" / "data" / "synthetic" / "train.jsonl", data)
    workdir = tmp_path / "run"
    shutil.copytree(copied_run, workdir, symlinks=True)
    config = write_changed(workdir, "config.yaml", datasets={"synthetic": {"source": "local", "path": str(data)}})
    samples = "results/prepared/synthetic/samples.parquet"
    snakemake(workdir, samples, "--configfile", str(workdir / config))
    assert plan(workdir, samples) == set()
    os.utime(data)
    assert plan(workdir, samples) == set(), "touch"
    shutil.copyfile(data, tmp_path / "copy.jsonl")
    shutil.copyfile(tmp_path / "copy.jsonl", data)
    assert plan(workdir, samples) == set(), "copied without -p"
    edit_in_place(data)
    assert plan(workdir, samples) == {"prepare_dataset"}, "edited, size and mtime kept"
    snakemake(workdir, samples)
    older = tmp_path / "older.jsonl"
    shutil.copyfile(data, older)
    edit_in_place(older)  # the content before the edit again: another file of the same size
    os.utime(older, ns=(1, 1))
    shutil.copy2(older, data)  # cp -p of an older file
    assert plan(workdir, samples) == {"prepare_dataset"}, "replaced by an older file"


def validate(workdir, *args) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "draftsmith.cli", "validate", *args], cwd=workdir,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc.returncode, (proc.stdout + proc.stderr).splitlines()


def commands(lines: list[str]) -> list[str]:
    """The rebuild commands validate printed, each once, in order."""
    out = []
    for line in lines:
        for cmd in line.split("`")[1::2]:
            if cmd.startswith("snakemake ") and cmd not in out:
                out.append(cmd)
    return out


def run_printed(workdir, command: str) -> None:
    """A printed command as the user would paste it, in the working directory (the venv's snakemake on the PATH)."""
    env = {**os.environ, "PATH": f"{os.path.dirname(SNAKEMAKE)}:{os.environ['PATH']}"}
    proc = subprocess.run(command, shell=True, cwd=workdir, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, f"{command}:\n{proc.stderr[-3000:]}"


@contextlib.contextmanager
def read_only(path):
    """`path` read-only for this process: a read-only bind mount as root (who ignores modes), else modes."""
    root = os.geteuid() == 0
    if root:
        if subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True).returncode != 0:
            pytest.skip("cannot bind-mount here")
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", str(path)], check=True)
            pytest.skip("cannot remount read-only here")
    else:
        subprocess.run(["chmod", "-R", "a-w", str(path)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)] if root else ["chmod", "-R", "u+w", str(path)], check=True)


@pytest.mark.slow  # minutes alone: `make test-slow` and CI run it
def test_validate_follows_the_chain_of_checksums_and_its_commands_fix_what_they_name(copied_run, tmp_path):
    r = copied_run / "results"
    status, out = validate(copied_run, "results")  # the config comes from the tree's record of its last run
    assert status == 0 and out[-1].endswith(" 0 failed"), "\n".join(out[-20:])

    bare = tmp_path / "bare" / "results"
    bare.mkdir(parents=True)
    status, out = validate(tmp_path / "bare", "results")
    assert status == 2 and len(out) == 1 and "no record of the config the tree was made with" in out[0], out
    assert "--config FILE" in out[0]

    # a read-only tree: `snakemake validate` stops with one line, `draftsmith validate` checks it
    with read_only(r):
        proc = snakemake(copied_run, "validate", check=False)
        status, out = validate(copied_run, "results")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "cannot be written" in line]
    assert errors and "draftsmith validate results` checks a read-only tree" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert status == 0, "\n".join(out[-20:])

    # a benchmark summary edited by hand; an emptied report with its figures deleted
    summary = r / "benchmark" / "default" / "summary.json"
    summary.write_text(json.dumps(json.loads(summary.read_text()), indent=1))
    (r / "report" / "report.html").write_text("")
    shutil.rmtree(r / "report" / "figures")
    status, out = validate(copied_run, "results")
    assert status == 1
    failed = "\n".join(line for line in out if line.startswith("FAIL"))
    assert "FAIL results/benchmark/default/summary.json: changed since rule benchmark made it (sha256 " in failed
    assert "FAIL results/report/figures: missing: the config implies this output (rule report)" in failed
    assert "FAIL results/report/report.html: " in failed
    printed = commands(out)
    assert printed and all("--configfile config.yaml" in c and str(copied_run) not in c for c in printed), printed
    assert any("--forcerun results/benchmark/default/summary.json" in c for c in printed), printed
    for command in printed:  # each fixes what it names
        run_printed(copied_run, command)
        status, out = validate(copied_run, "results")
        named = [line for line in out if line.startswith("FAIL") and command in commands([line])]
        assert not named, named
    assert status == 0, "\n".join(out[-20:])

    # the draft's weights changed after training, checked against a config with another lr
    weights = r / "draft" / "default" / "model.safetensors"
    edit_in_place(weights)
    write_changed(copied_run, "lr.yaml", training={"lr": 0.0005})
    status, out = validate(copied_run, "results", "--config", "lr.yaml")
    assert status == 1
    failed = "\n".join(line for line in out if line.startswith("FAIL"))
    assert "FAIL results/draft/default/model.safetensors: changed since rule train_draft made it" in failed
    assert ("FAIL results/draft/default/config.json: stale for this config (and 3 more outputs of its job): Snakemake "
            "would rebuild it (rule train_draft: params changed)") in failed
    printed = commands(out)
    assert printed and all("--configfile lr.yaml" in c for c in printed), printed
    for command in printed:
        run_printed(copied_run, command)
    status, out = validate(copied_run, "results", "--config", "lr.yaml")
    assert status == 0, "\n".join(out[-20:])
    status, out = validate(copied_run, "results")  # the last run's config is now lr.yaml
    assert status == 0, "\n".join(out[-20:])
