"""The workflow's own rules with the vLLM backends on the real engine, as a user's run does on a GPU node, here on the
engine's CPU platform: Snakemake builds the target, prepares the data, runs preflight, extracts a shard with
`extraction.backend: vllm` (scripts/extract_hidden_states.py validates it), trains the draft, and benchmarks it with
`benchmark.backend: vllm` (`vllm serve`, target alone and then with the draft, each server sweeping
`benchmark.batch_sizes` [1, 2]: one request in flight, then two) through the test-only CPU worker
(`benchmark.cpu_test_worker`), with the offline benchmark of the same draft beside it (`benchmark.offline_reference`).
Then, on those files:

- vLLM's own Eagle3 model class, loaded by the test-only worker in this process as `vllm serve` loads it, holds the
  trained checkpoint exactly: every parameter equal to the checkpoint's tensor, none left out (vLLM does not check
  that for Eagle3: its load_weights returns None), nothing skipped or reported missing in vLLM's logs; d2t as
  trained, t2d the set of targets d2t maps to; the target's auxiliary layers those of the draft config;
- vLLM's draft/accept counters equal the offline benchmark's prompt by prompt (float32), and vLLM's output with the
  draft equals its output without it, which equals transformers' greedy output;
- the sweep's counters add up: at each batch size the server's counter deltas equal the per-request totals (each
  request's own delta at size 1), and the sizes' deltas the whole run's.

The last rule, the report, needs the core venv's plotting stack (`make demo-vllm` runs it there);
tests/test_report_backends.py covers its offline-vs-vLLM section.
"""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
from conftest import snakemake, write_config
from engine_support import AUX, ENGINE_TARGET, skip_module_unless_engine_runs

skip_module_unless_engine_runs()

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

from draftsmith.benchmark.results import accept_columns  # noqa: E402
from draftsmith.benchmark.vllm_server import free_port, speculative_config  # noqa: E402
from draftsmith.data.prompts import load_prompts  # noqa: E402
from draftsmith.data.tokenization import read_samples  # noqa: E402
from draftsmith.extraction.shards import validate_shard  # noqa: E402
from draftsmith.report.backends import backends_table  # noqa: E402
from draftsmith.vllm_stack.probes import CPU_TEST_WORKER  # noqa: E402

pytestmark = pytest.mark.engine
K, MAX_NEW_TOKENS, PROMPTS = 2, 32, 4
SIZES = [1, 2]  # benchmark.batch_sizes: the vllm backend's concurrency sweep
COUNTERS = ["prompt_tokens", "new_tokens", "target_forwards", "drafts", "draft_tokens", "accepted_tokens",
            *accept_columns(K)]
# what vLLM logs when a checkpoint's weights do not fit the model (AutoWeightsLoader, DefaultModelLoader, Eagle3)
WEIGHT_PROBLEM = re.compile(r"weight|checkpoint|missing|unexpected|not initialized|skipp|ignor", re.IGNORECASE)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The DAG up to both benchmarks, once for the module; returns the working directory."""
    if not current_platform.is_cpu():
        pytest.fail("this module runs vLLM on its CPU platform (the test-only worker); on a GPU node serve the draft "
                    "with vLLM's own worker instead")
    workdir = tmp_path_factory.mktemp("vllm_pipeline")
    write_config(workdir, {
        "embedded_target": ENGINE_TARGET,
        "synthetic": {"num_records": 40, "num_heldout": PROMPTS},
        "extraction": {"backend": "vllm", "num_shards": 1, "aux_layer_ids": AUX, "dtype": "float32", "batch_size": 16,
                       "tensor_parallel_size": 1},
        "benchmark": {"backend": "vllm", "cpu_test_worker": True, "offline_reference": True, "num_prompts": PROMPTS,
                      "num_speculative_tokens": K, "max_new_tokens": MAX_NEW_TOKENS, "dtype": "float32",
                      "batch_sizes": SIZES},
    })
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as env:
        # Training here runs on the engine venv's torch 2.10, where speculators' compiled FlexAttention forward fails
        # in inductor on a CPU (IndexError, after draftsmith's eager backward probe passed): train eagerly.
        env.setenv("TORCH_COMPILE_DISABLE", "1")
        # one thread per job (rules set torch's threads to theirs, the vLLM engine takes OMP_NUM_THREADS): this tiny
        # target gains nothing from two, and on a 2-core machine with other load, spinning OpenMP threads made the
        # offline benchmark ~10x slower (95 s instead of 7 s for the same prompts)
        env.setenv("OMP_NUM_THREADS", "1")
        snakemake(workdir, "--cores", "1", "--until", "benchmark", "benchmark_offline_reference")
    print(f"snakemake up to both benchmarks: {time.perf_counter() - start:.0f} s")
    return workdir


def test_snakemake_runs_the_dag_with_the_vllm_backends(run):
    results = run / "results"
    manifest_path = results / "shards" / "synthetic" / "shard_0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["backend"] == "vllm" and manifest["dtype"] == "float32"
    assert manifest["vllm"]["fixes_applied"]
    validate_shard(manifest_path.parent, read_samples(results / "prepared" / "synthetic" / "samples.parquet"), deep=True)
    # the benchmark job's own preflight (stage benchmark) passed, with the test-only worker named
    preflight = (results / "logs" / "benchmark" / "default.log").read_text()
    serving = next(line for line in preflight.splitlines() if "preflight (benchmark) [  ok] eagle3 serving" in line)
    assert f"TEST-ONLY worker {CPU_TEST_WORKER}" in serving
    summary = json.loads((results / "benchmark" / "default" / "summary.json").read_text())
    assert summary["backend"] == "vllm" and summary["cpu_test_worker"] == CPU_TEST_WORKER
    assert summary["speculative_config"]["disable_padded_drafter_batch"] is True
    log = (results / "benchmark" / "default" / "vllm_serve_eagle3_draft.log").read_text()
    assert f"'worker_cls': '{CPU_TEST_WORKER}'" in log  # vllm serve ran the draft through the test-only worker


# ----------------------------------------------------------------------------- the draft inside vLLM


def vllm_parameters(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the names of vLLM's Eagle3LlamaForCausalLM parameters: q/k/v and gate/up
    stacked (QKVParallelLinear, MergedColumnParallelLinear), `model.` before all but lm_head, d2t as
    draft_id_to_target_id; t2d has no parameter (vLLM maps draft to target ids with d2t alone)."""
    out, stacked = {}, {}
    for name, tensor in checkpoint.items():
        if name == "t2d":
            continue
        if name == "d2t":
            out["draft_id_to_target_id"] = tensor
            continue
        name = name if name.startswith("lm_head") else f"model.{name}"
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            part = next((p for p in parts if f".{p}." in name), None)
            if part:
                stacked.setdefault(name.replace(part, fused), {})[parts.index(part)] = tensor
                break
        else:
            out[name] = tensor
    for name, pieces in stacked.items():
        out[name] = torch.cat([pieces[i] for i in sorted(pieces)])
    return out


@pytest.fixture(scope="module")
def vllm_draft(run):
    """vLLM's test-only CPU worker, in this process, with target and draft loaded as `vllm serve` loads them; and
    every record vLLM logged meanwhile (DEBUG included: the weight loader reports skipped weights at DEBUG)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.engine.arg_utils import EngineArgs

    from draftsmith.vllm_stack.cpu_spec_worker import CPUSpecDecodeWorker

    results = run / "results"
    config = EngineArgs(model=str(results / "target"), dtype="float32", enforce_eager=True, max_model_len=512,
                        worker_cls=CPU_TEST_WORKER,
                        speculative_config=speculative_config(results / "draft" / "default", K, True)).create_engine_config()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.DEBUG)
    try:
        worker = CPUSpecDecodeWorker(config, local_rank=0, rank=0, is_driver_worker=True,
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        worker.init_device()
        worker.load_model()
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
    yield worker, records
    cleanup_dist_env_and_memory()


def test_vllms_eagle3_model_class_holds_the_trained_draft(run, vllm_draft):
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    worker, records = vllm_draft
    draft_dir = run / "results" / "draft" / "default"
    checkpoint = load_file(draft_dir / "model.safetensors")
    draft_config = json.loads((draft_dir / "config.json").read_text())
    model = worker.model_runner.drafter.model
    assert isinstance(model, Eagle3LlamaForCausalLM)
    params = dict(model.named_parameters())
    expected = vllm_parameters(checkpoint)
    assert sorted(params) == sorted(expected), "parameters without a checkpoint tensor, or tensors without a parameter"
    for name, tensor in expected.items():
        param, layer = params[name], model.get_submodule(name.rpartition(".")[0])
        if param.numel() == 0 and hasattr(layer, "cpu_linear"):
            # vLLM's CPU platform packed this weight for oneDNN or its SGL kernel (on AVX-512 machines) and left an
            # empty parameter (model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm): the layer must then
            # compute x @ W^T with the checkpoint's W, up to the packed GEMM's summation order.
            x = torch.randn(5, tensor.shape[1], dtype=param.dtype)
            torch.testing.assert_close(layer.cpu_linear(x, param, None), torch.nn.functional.linear(x, tensor.to(x.dtype)),
                                       rtol=1e-4, atol=1e-5, msg=name)
        else:
            assert torch.equal(param.detach(), tensor.to(param.dtype)), name
    d2t, t2d = checkpoint["d2t"], checkpoint["t2d"]
    assert torch.equal(model.draft_id_to_target_id, d2t)
    targets = torch.arange(len(d2t)) + d2t
    assert torch.equal(torch.nonzero(t2d).view(-1), targets)  # t2d marks exactly the targets the draft can propose
    logits = model.compute_logits(torch.randn(3, model.config.hidden_size))
    assert torch.equal(torch.isfinite(logits), t2d.expand(3, -1))
    aux = worker.model_runner.model.model.aux_hidden_state_layers
    assert aux == tuple(draft_config["eagle_aux_hidden_state_layer_ids"]) == tuple(AUX)
    messages = [r.getMessage() for r in records]
    assert any(m.startswith("Loaded weight draft_id_to_target_id") for m in messages)  # the capture saw the loader
    problems = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records
                if (r.levelno >= logging.WARNING and WEIGHT_PROBLEM.search(r.getMessage()))
                or r.getMessage().startswith(("Skipping", "Ignoring"))]
    assert problems == []


def test_the_stock_cpu_runner_refuses_what_the_test_worker_runs(vllm_draft):
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    worker, _ = vllm_draft
    with pytest.raises(AssertionError, match="spec decode is not supported"):
        CPUModelRunner(worker.vllm_config, torch.device("cpu"))


# ----------------------------------------------------------------------------- vLLM's counters and the offline ones


def test_vllm_counters_equal_the_offline_benchmark_prompt_by_prompt(run):
    bench = run / "results" / "benchmark" / "default"
    vllm, offline = pd.read_csv(bench / "per_prompt.csv"), pd.read_csv(bench / "offline" / "per_prompt.csv")
    assert set(vllm["backend"]) == {"vllm"} and set(offline["backend"]) == {"offline"}

    def counters(df):
        rows = df[(df["method"] == "eagle3_draft") & (df["batch_size"] == 1)].sort_values("prompt_id")
        return rows[["prompt_id", *COUNTERS]].astype({c: int for c in COUNTERS}).reset_index(drop=True)

    ours, theirs = counters(vllm), counters(offline)
    assert len(ours) == PROMPTS
    pd.testing.assert_frame_equal(ours, theirs)
    accepted, proposed = int(ours["accepted_tokens"].sum()), int(ours["draft_tokens"].sum())
    print(f"{PROMPTS} prompts: {int(ours['drafts'].sum())} drafts, {accepted} of {proposed} draft tokens accepted")
    assert 0 < accepted < proposed, "the comparison needs both accepted and rejected draft tokens"
    table = backends_table([bench / "summary.json"], [bench / "offline" / "summary.json"])
    assert list(table["prompts with equal counters"]) == [f"{PROMPTS} of {PROMPTS}"]


def test_vllm_output_with_the_draft_equals_greedy_decoding(run):
    from draftsmith.decoding.target import TargetModel
    from draftsmith.decoding.reference import greedy_decode
    from draftsmith.target_model.spec import TargetSpec, stop_token_ids

    results = run / "results"
    bench = results / "benchmark" / "default"
    summary = json.loads((bench / "summary.json").read_text())
    outputs = json.loads((bench / "vllm_outputs.json").read_text())
    assert summary["methods"]["eagle3_draft"]["lossless"] is True
    assert outputs["eagle3_draft"] == outputs["target_greedy"]
    by_size = json.loads((bench / "vllm_outputs_by_batch_size.json").read_text())
    assert by_size == {str(size): outputs for size in SIZES}  # two requests in flight decode the same tokens
    target = TargetSpec(str(results / "target"), dtype="float32")
    tokenizer, model = target.load_tokenizer(), target.load_causal_lm(torch.float32).eval()
    runner, stop = TargetModel(model), stop_token_ids(tokenizer, model)
    prompts = load_prompts(str(results / "data" / "synthetic" / "heldout.jsonl"), PROMPTS)
    assert sorted(outputs["target_greedy"]) == sorted(p["prompt_id"] for p in prompts)
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(prompt["messages"], add_generation_prompt=True, tokenize=True)
        assert outputs["target_greedy"][prompt["prompt_id"]] == greedy_decode(runner, ids, MAX_NEW_TOKENS, stop).tokens


# ----------------------------------------------------------------------------- the concurrency sweep


def test_the_sweeps_counters_add_up_to_the_per_request_totals_at_every_size(run):
    bench = run / "results" / "benchmark" / "default"
    summary = json.loads((bench / "summary.json").read_text())
    per_prompt = pd.read_csv(bench / "per_prompt.csv")
    assert summary["batch_sizes"] == SIZES
    assert per_prompt.groupby(["batch_size", "method"]).size().to_dict() == {
        (size, method): PROMPTS for size in SIZES for method in ("target_greedy", "eagle3_draft")}
    spec = summary["methods"]["eagle3_draft"]
    per_size = spec["per_batch_size"]
    assert list(per_size) == ["1", "2"]
    # the per-request totals: each request's own counter delta, read around it at batch size 1
    at_1 = per_prompt[(per_prompt["method"] == "eagle3_draft") & (per_prompt["batch_size"] == 1)]
    requests = {"drafts": int(at_1["drafts"].sum()), "draft_tokens": int(at_1["draft_tokens"].sum()),
                "accepted": int(at_1["accepted_tokens"].sum()),
                "accepted_per_pos": [int(at_1[c].sum()) for c in accept_columns(K)]}
    assert per_size["1"]["requests_add_up"] is True and per_size["1"]["per_request_counters"] == requests
    # at each size the server's counter delta over the size equals them: at 2 in flight vLLM's counters cannot be split
    # by request, but greedy decoding in float32 drafts and accepts the same tokens per request at either size
    for size in ("1", "2"):
        assert per_size[size]["counters"] == requests, size
        assert per_size[size]["lossless"] is True and per_size[size]["in_flight"] == int(size)
        new_tokens = per_size[size]["new_tokens"]
        # every token is the prefill's or a verification's (accepted drafts plus the target's own); the last round of
        # a request may run up to k tokens past max_new_tokens, which its output drops
        assert new_tokens <= PROMPTS + requests["drafts"] + requests["accepted"] <= new_tokens + PROMPTS * K
        assert per_size[size]["acceptance_length"] == pytest.approx(new_tokens / (PROMPTS + requests["drafts"]))
        greedy = summary["methods"]["target_greedy"]["per_batch_size"][size]
        assert per_size[size]["speedup"] == pytest.approx(per_size[size]["tokens_per_s"] / greedy["tokens_per_s"])
    assert per_size["2"]["requests_add_up"] is None and at_1["drafts"].notna().all()
    assert per_prompt[(per_prompt["method"] == "eagle3_draft") & (per_prompt["batch_size"] == 2)]["drafts"].isna().all()
    # the sizes' deltas add up to the delta over the whole run (after the warm-up request): nothing else was counted
    assert spec["sizes_add_up"] is True
    assert spec["counters_all_sizes"]["drafts"] == len(SIZES) * requests["drafts"]
    assert spec["pays_up_to"] in (None, 1, 2)
    log = (bench / "vllm_serve_eagle3_draft.log").read_text()
    assert "'max_num_seqs': 2" in log or "max_num_seqs=2" in log  # one server holds the largest size
