"""Config layering in any order of --configfile files, the paths a config names (checked and resolved against its
folder before any job), and what a run says about them at its start."""

from __future__ import annotations

import subprocess

import pytest
from conftest import REPO, SNAKEMAKE, jobs_planned

from draftsmith.config.notices import benchmark_prompts_notice
from draftsmith.config.workflow import ConfigError, load_config

TINY = REPO / "config" / "tiny.yaml"


@pytest.fixture
def mine(tmp_path):
    """A user's config beside their data, naming it by a path relative to the config's folder."""
    from draftsmith.data.synthetic import generate_corpus
    from draftsmith.io import write_jsonl

    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "chats.jsonl", generate_corpus(20, 1, seed=5)[0])
    path = tmp_path / "mine.yaml"
    path.write_text(f"results: {tmp_path / 'results'}\n"
                    "datasets:\n  mine: {source: local, path: data/chats.jsonl}\n"
                    "variants:\n  wide: {draft_layers: 2}\n"
                    "training:\n  lr: 0.01\n"
                    "benchmark:\n  methods: [target_greedy, eagle3_draft]\n")
    return path


def dry_run(workdir, *args):
    return subprocess.run([SNAKEMAKE, "-n", "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--cores", "2",
                           *args], capture_output=True, text=True)


def test_a_later_file_replaces_named_maps_and_lists_and_merges_sections_in_either_order(mine, tmp_path):
    """tiny.yaml then the user's file: only the user's dataset and variant (tiny's synthetic corpus was once kept
    beside them); the user's lr over tiny's training section, whose other keys stay; the user's methods list
    replaces tiny's. The other order: tiny's datasets, variants, lr and list win, as the later file."""
    config = load_config([TINY, mine])
    assert list(config["datasets"]) == ["mine"] and list(config["variants"]) == ["wide"]
    assert config["datasets"]["mine"]["path"] == str(tmp_path / "data" / "chats.jsonl")
    assert (config["training"]["lr"], config["training"]["epochs"]) == (0.01, 4)  # 4: tiny's, the default says 2
    assert config["benchmark"]["methods"] == ["target_greedy", "eagle3_draft"]
    assert config["results"] == str(tmp_path / "results")
    reverse = load_config([mine, TINY])
    assert list(reverse["datasets"]) == ["synthetic"] and list(reverse["variants"]) == ["default"]
    assert reverse["training"]["lr"] == 0.001 and reverse["results"] == "results"
    assert reverse["benchmark"]["methods"] == ["target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft"]


def test_the_workflow_layers_as_documented_and_says_where_paths_and_benchmark_prompts_come_from(mine, tmp_path):
    proc = dry_run(tmp_path, "--configfile", str(TINY), str(mine))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert jobs_planned(proc)["prepare_dataset"] == 1 and "results/prepared/mine/" in proc.stdout
    assert "prepared/synthetic/" not in proc.stdout and "draft/default/" not in proc.stdout
    assert f"datasets.mine.path: data/chats.jsonl resolved against {tmp_path} (the folder of mine.yaml)" in proc.stderr
    assert ("benchmark prompts: the synthetic corpus' held-out prompts (benchmark.prompts: heldout, set in "
            f"{TINY}), not from your datasets 'mine'") in proc.stderr
    proc = dry_run(tmp_path, "--configfile", str(mine), str(TINY))
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "results/prepared/synthetic/" in proc.stdout and "prepared/mine/" not in proc.stdout
    assert "benchmark prompts:" not in proc.stderr and "resolved against" not in proc.stderr


def test_the_notice_names_mt_bench_too_and_is_silent_for_the_shipped_configs(mine):
    assert benchmark_prompts_notice(load_config([]), []) is None
    assert benchmark_prompts_notice(load_config([TINY]), [TINY]) is None
    notice = benchmark_prompts_notice(load_config([mine]), [mine])
    assert notice.startswith("benchmark prompts: MT-Bench's questions (benchmark.prompts: mt_bench, set in "
                             f"{REPO / 'config' / 'config.yaml'}), "
                             "not from your datasets 'mine'")


def test_every_missing_or_wrong_path_is_one_line_naming_the_file_and_key_before_any_job(tmp_path):
    """A missing dataset file was Snakemake's MissingInputException naming no key; a missing target directory
    passed the dry run and failed 63 s later with HFValidationError."""
    (tmp_path / "data").mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text("datasets:\n  mine: {source: local, path: data/missing.jsonl}\n  folder: {source: local, path: data}\n"
                   f"target:\n  model: {tmp_path / 'models' / 'llama'}\n"
                   "benchmark:\n  prompts: {source: local, path: ../nowhere/prompts.jsonl}\n")
    with pytest.raises(ConfigError) as e:
        load_config([bad])
    assert str(e.value).splitlines() == [
        f"{bad}: datasets.mine.path: {tmp_path / 'data' / 'missing.jsonl'} does not exist",
        f"{bad}: datasets.folder.path: {tmp_path / 'data'} is a directory; give a .jsonl, .json or .parquet file",
        f"{bad}: benchmark.prompts.path: {tmp_path.parent / 'nowhere' / 'prompts.jsonl'} does not exist",
        f"{bad}: target.model: target directory {tmp_path / 'models' / 'llama'} does not exist",
    ]
    proc = dry_run(tmp_path, "--configfile", str(TINY), str(bad))
    assert proc.returncode != 0 and f"{bad}: target.model: target directory" in proc.stdout
    assert "Job stats" not in proc.stdout and "MissingInputException" not in proc.stdout + proc.stderr
    # a hub id is not a path; a directory beside the config file is one, resolved against its folder
    (tmp_path / "org" / "model").mkdir(parents=True)
    (tmp_path / "org" / "model" / "config.json").write_text("{}")
    hub = tmp_path / "hub.yaml"
    hub.write_text("target: {model: meta-llama/Llama-3.1-8B-Instruct}\n")
    assert load_config([hub])["target"]["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    hub.write_text("target: {model: org/model}\n")
    assert load_config([hub])["target"]["model"] == str(tmp_path / "org" / "model")


def test_a_gpu_count_this_machine_cannot_give_fails_the_dry_run_naming_the_key(tmp_path):
    """training.gpus: 4 passed `snakemake -n` on a CPU machine (the real run stopped it); a dry run planning for
    another machine declares its GPUs with --resources gpu=N."""
    gpus = tmp_path / "gpus.yaml"
    gpus.write_text(f"results: {tmp_path / 'results'}\ntraining: {{gpus: 4}}\nextraction: {{device: cpu}}\n")
    proc = dry_run(tmp_path, "--configfile", str(TINY), str(gpus))
    assert proc.returncode != 0
    assert "gpus (training): training.gpus=4 but 0 GPU(s) are visible" in proc.stdout + proc.stderr
    proc = dry_run(tmp_path, "--configfile", str(TINY), str(gpus), "--resources", "gpu=4")
    assert proc.returncode == 0, proc.stdout[-3000:]
