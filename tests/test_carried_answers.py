"""perf carried_answers on a real run's answers: regenerate's output packed into parts, the parts unpacked from two
folders into the same files, and the pipeline's own prepare_dataset, given the unpacked files as local datasets
through the overlay, makes the samples and stats it made from the originals (regenerate's counts included)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import copy_run, jobs_planned, snakemake, write_config

from draftsmith.io import read_json
from perf import carried_answers

DATASETS = ("synthetic", "fastchat")


@pytest.fixture(scope="module")
def answered(tmp_path_factory) -> Path:
    """The tiny configuration with its synthetic corpus and FastChat's prompts answered by the target (rule
    regenerate: a few prompts, short answers) and prepared; returns the working directory. (The session's
    pipeline_run regenerates nothing.)"""
    workdir = tmp_path_factory.mktemp("answered")
    write_config(workdir, {
        "embedded_target": {"pretrain_steps": 40},
        "synthetic": {"num_records": 24, "num_heldout": 2},
        "datasets": {"synthetic": {"source": "synthetic", "regenerate": True, "max_records": 12},
                     "fastchat": {"source": "fastchat", "regenerate": True, "max_records": 8}},
        "regenerate": {"max_new_tokens": 12, "temperature": 0.0, "chunk_size": 4, "batch_size": 4, "device": "cpu",
                       "dtype": "float32"},
    })
    snakemake(workdir, *[str(workdir / "results" / "prepared" / d / "samples.parquet") for d in DATASETS])
    return workdir


def originals(workdir: Path) -> list[Path]:
    folder = workdir / "results" / "data" / "regenerated"
    return [folder / f"{d}{ext}" for d in DATASETS for ext in (".jsonl", ".stats.json")]


def pack(workdir: Path, out: Path, part_kib: float, *extra: str) -> list[Path]:
    carried_answers.main(["pack", str(workdir / "results"), "--out", str(out), "--part-mib", str(part_kib / 1024),
                          *extra])
    return sorted(out.glob("answers.tar.xz.part_*"))


def split(parts: list[Path], sums: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The first part and answers.sha256 in one folder, the other parts in another (two carries)."""
    first, second = tmp_path / "carried1", tmp_path / "carried2"
    first.mkdir()
    second.mkdir()
    shutil.copy(sums, first)
    shutil.copy(parts[0], first)
    for part in parts[1:]:
        shutil.copy(part, second)
    return first, second


@pytest.fixture(scope="module")
def packed(answered, tmp_path_factory) -> list[Path]:
    """The answers in parts of 1/5 of the stream each (five or six parts and answers.sha256)."""
    out = tmp_path_factory.mktemp("packed")
    pack(answered, out, 1e6)
    size = (out / "answers.tar.xz.part_00").stat().st_size  # one part: the whole stream
    shutil.rmtree(out)
    return pack(answered, out, size / 5 / 1024)


def unpack(dirs, into: Path, overlay: Path, *extra: str) -> dict:
    carried_answers.main(["unpack", *map(str, dirs), "--into", str(into), "--overlay", str(overlay), *extra])
    return yaml.safe_load(overlay.read_text())


def test_parts_unpacked_from_two_folders_are_the_files_and_the_overlay_names_them(answered, packed, tmp_path,
                                                                                   capsys):
    assert 5 <= len(packed) <= 6
    sums = packed[0].parent / "answers.sha256"
    assert sums.read_text().count("\n") == len(packed) + 1  # each part and the whole stream
    assert not [p for p in packed[0].parent.iterdir() if p.name.startswith(".")]  # no temporary file left
    dirs = split(packed, sums, tmp_path)
    overlay = unpack(dirs, tmp_path / "answers", tmp_path / "answers.yaml")
    for original in originals(answered):
        assert (tmp_path / "answers" / original.name).read_bytes() == original.read_bytes()
    assert sorted(p.name for p in (tmp_path / "answers").iterdir()) == sorted(p.name for p in originals(answered))
    assert overlay == {"datasets": {d: {"source": "local", "path": str(tmp_path / "answers" / f"{d}.jsonl")}
                                    for d in DATASETS}}
    header = (tmp_path / "answers.yaml").read_text().split("datasets:")[0]
    assert "replaces the whole datasets map" in header and "answers.tar.xz.part_00" in header
    assert all(Path(spec["path"]).is_absolute() for spec in overlay["datasets"].values())
    # --configs: the overlay keeps each carried dataset's keep_cut_answers and the datasets not carried
    config = yaml.safe_load((answered / "config.yaml").read_text())
    config["datasets"]["synthetic"]["keep_cut_answers"] = False
    config["datasets"]["mine"] = {"source": "self", "num_prompts": 2, "regenerate": True}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    overlay = unpack(dirs, tmp_path / "answers", tmp_path / "answers.yaml", "--configs", str(tmp_path / "run.yaml"))
    assert overlay["datasets"]["synthetic"]["keep_cut_answers"] is False
    assert overlay["datasets"]["mine"] == config["datasets"]["mine"]
    assert "dataset mine is regenerated" in capsys.readouterr().out


def test_a_changed_or_missing_part_is_named(packed, tmp_path):
    first, second = split(packed, packed[0].parent / "answers.sha256", tmp_path)
    changed = second / packed[2].name
    changed.write_bytes(changed.read_bytes()[:-1])  # cut short
    with pytest.raises(SystemExit, match=rf"{changed}: sha256 .* differs.*bring {packed[2].name} again"):
        unpack([first, second], tmp_path / "answers", tmp_path / "answers.yaml")
    changed.unlink()
    with pytest.raises(SystemExit, match=rf"missing: {packed[2].name}; .* names {len(packed)} parts"):
        unpack([first, second], tmp_path / "answers", tmp_path / "answers.yaml")
    assert not (tmp_path / "answers").exists() and not (tmp_path / "answers.yaml").exists()


def test_more_than_eight_files_is_refused_and_leaves_nothing(answered, packed, tmp_path):
    size = sum(p.stat().st_size for p in packed)
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=r"is .* KiB: 8 parts .* 9 files, more than the 8 allowed.*--part-mib .* would "
                                         r"fit.*--datasets, .*these are: fastchat,synthetic"):
        pack(answered, out, size / 7.5 / 1024)
    assert list(out.iterdir()) == []
    with pytest.raises(SystemExit, match=rf"{len(packed) + 1} files, more than the 4 allowed"):
        pack(answered, out, size / 5 / 1024, "--max-files", "4")
    assert list(out.iterdir()) == []


def test_the_pipeline_prepares_the_carried_answers_as_it_prepared_the_originals(answered, packed, tmp_path):
    """In a copy of the run without its answers and prepared samples, the overlay (the last config file) makes the
    datasets local files: prepare_dataset alone runs (nothing regenerates), and makes the same samples and stats."""
    run = copy_run(answered, tmp_path / "run")
    shutil.rmtree(run / "results" / "data" / "regenerated")
    shutil.rmtree(run / "results" / "prepared")
    unpack(split(packed, packed[0].parent / "answers.sha256", tmp_path), tmp_path / "answers",
           tmp_path / "answers.yaml")
    targets = [str(run / "results" / "prepared" / d / "samples.parquet") for d in DATASETS]
    done = snakemake(run, *targets, "--configfile", str(run / "config.yaml"), str(tmp_path / "answers.yaml"))
    assert jobs_planned(done) == {"prepare_dataset": 2}
    for d in DATASETS:
        carried = pd.read_parquet(run / "results" / "prepared" / d / "samples.parquet")
        original = pd.read_parquet(answered / "results" / "prepared" / d / "samples.parquet")
        assert len(carried) == len(original) > 0
        assert carried["sample_id"].tolist() == original["sample_id"].tolist()
        assert [list(x) for x in carried["input_ids"]] == [list(x) for x in original["input_ids"]]
        assert [list(x) for x in carried["loss_mask"]] == [list(x) for x in original["loss_mask"]]
        stats = read_json(run / "results" / "prepared" / d / "stats.json")
        assert stats["regenerate"] == read_json(answered / "results" / "data" / "regenerated" / f"{d}.stats.json")
        assert stats == read_json(answered / "results" / "prepared" / d / "stats.json")


def test_a_dataset_regenerate_did_not_finish_is_left_out_unless_named(answered, tmp_path, capsys):
    """A run cut short (answers without their stats): the finished datasets are packed, the other named."""
    results = tmp_path / "results"
    shutil.copytree(answered / "results" / "data" / "regenerated", results / "data" / "regenerated")
    (results / "data" / "regenerated" / "fastchat.stats.json").unlink()
    with pytest.raises(SystemExit, match=r"fastchat.jsonl: no fastchat.stats.json beside it"):
        carried_answers.main(["pack", str(results), "--out", str(tmp_path / "out"), "--datasets", "fastchat"])
    carried_answers.main(["pack", str(results), "--out", str(tmp_path / "out")])
    assert "no fastchat.stats.json beside it (rule regenerate writes both; did it finish?): left out" in \
        capsys.readouterr().out
    overlay = unpack([tmp_path / "out"], tmp_path / "answers", tmp_path / "answers.yaml")
    assert list(overlay["datasets"]) == ["synthetic"]


def test_packs_of_two_sessions_unpack_together(answered, tmp_path):
    """Each dataset packed alone (--datasets, as two sessions would), each pack in its own folder: one unpack of
    both folders, each part found by its name and sha256 (both packs have a part_00)."""
    for d in DATASETS:
        pack(answered, tmp_path / f"pack_{d}", 1e6, "--datasets", d)
    overlay = unpack([tmp_path / f"pack_{d}" for d in DATASETS], tmp_path / "answers", tmp_path / "answers.yaml")
    assert set(overlay["datasets"]) == set(DATASETS)
    for original in originals(answered):
        assert (tmp_path / "answers" / original.name).read_bytes() == original.read_bytes()
    assert (tmp_path / "answers.yaml").read_text().count("answers.tar.xz.part_00 .. answers.tar.xz.part_00") == 2
    pack(answered, tmp_path / "both", 1e6)
    with pytest.raises(SystemExit, match=r"synthetic.jsonl.*is one twice"):  # the same dataset in two packs
        unpack([tmp_path / "both", tmp_path / "pack_synthetic"], tmp_path / "again", tmp_path / "again.yaml")
    assert not (tmp_path / "again").exists() or not list((tmp_path / "again").iterdir())
