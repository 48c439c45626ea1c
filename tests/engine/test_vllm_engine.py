"""draftsmith's vllm extraction backend on the real vLLM 0.16.0 engine: MultiprocExecutor, the platform's worker
process and model runner (CPUWorker / CPUModelRunner under .venv-vllm), its attention kernels, KV cache and
Scheduler, with draftsmith's CaptureWorkerExtension inside the worker. Nothing is replaced.

One engine serves the whole module (starting one takes 30-60 s on a loaded 2-core machine); a test that breaks a
batch on purpose (a fix disabled) is followed by `reset_engine` and a check that the engine still extracts
correctly, so one test's failure cannot leak into the next. Each fix the running engine exercises is shown
failing without it (`vllm_compat.disabled`) and passing with it.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import build_target, hf_backend, prepare_samples
from engine_support import AUX, BATCHED_TOKENS, ENGINE_TARGET, MAX_MODEL_LEN, reset_engine, skip_module_unless_engine_runs

skip_module_unless_engine_runs()

from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.core.kv_cache_utils import _get_kv_cache_groups_uniform_spec, get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.executor.multiproc_executor import MultiprocExecutor  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from draftsmith.data.tokenization import read_samples  # noqa: E402
from draftsmith.extraction.driver import extract_shard  # noqa: E402
from draftsmith.extraction.hf_backend import HFHiddenStateExtractor  # noqa: E402
from draftsmith.extraction.shards import ShardError, validate_shard  # noqa: E402
from draftsmith.extraction.vllm_backend import (  # noqa: E402
    CaptureError,
    FixedVllmHiddenStatesGenerator,
    VllmBackend,
    build_vllm_config,
)
from draftsmith.io import sha256_file  # noqa: E402
from draftsmith.provenance import model_fingerprint  # noqa: E402
from draftsmith.target_model.spec import TargetSpec  # noqa: E402
from draftsmith.vllm_stack import compat  # noqa: E402

pytestmark = pytest.mark.engine
VLLM_CFG = {"batch_size": 12, "max_model_len": None, "tensor_parallel_size": 1, "gpu_memory_utilization": 0.8,
            "dtype": "float32"}


def vllm_shard(gen, target, samples_path, samples, out):
    """One shard through the extraction driver with the vllm backend on the given engine."""
    backend = VllmBackend(TargetSpec(str(target)), AUX, {**VLLM_CFG, "max_model_len": MAX_MODEL_LEN}, generator=gen)
    return extract_shard(samples, sha256_file(samples_path), 0, 2, out, backend, model_fingerprint(target))
DTYPE = "float32"  # the hf backend's reference dtype; bf16 attention is not available in every CPU build
# fp32 on both sides; measured max |vllm - hf| on this target: 6e-7 (vLLM's CPU attention kernel and fused RMSNorm
# against transformers' eager attention and RMSNorm sum in another order)
ATOL = 1e-4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return build_target(tmp_path_factory.mktemp("engine_target"), ENGINE_TARGET)


@pytest.fixture(scope="module")
def samples_path(target, tmp_path_factory):
    return prepare_samples(target, tmp_path_factory.mktemp("engine_samples"))


@pytest.fixture(scope="module")
def samples(samples_path):
    return read_samples(samples_path)


@pytest.fixture(scope="module")
def reference(target):
    return HFHiddenStateExtractor(str(target), AUX, "cpu", DTYPE)


@pytest.fixture(scope="module")
def gen(target):
    start = time.perf_counter()
    generator = FixedVllmHiddenStatesGenerator(str(target), AUX, max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                                               dtype=DTYPE, max_num_batched_tokens=BATCHED_TOKENS)
    print(f"vLLM engine started in {time.perf_counter() - start:.1f} s")
    yield generator
    generator.executor.shutdown()


@pytest.fixture(autouse=True)
def engine_left_clean(request):
    """After each test that used the engine: back to a clean state, and still extracting what it should."""
    uses_engine = "gen" in request.fixturenames
    gen, samples = (request.getfixturevalue("gen"), request.getfixturevalue("samples")) if uses_engine else (None, None)
    yield
    if uses_engine:
        reset_engine(gen)
        batch = batch_of(samples, 3)
        assert [r["input_ids"].tolist() for r in gen.generate(batch)] == batch, "the engine did not recover"
        assert not gen.scheduler.has_unfinished_requests()


def batch_of(samples, n):
    return [samples["input_ids"][i] for i in range(n)]


def chunked_batch(samples, n=12):
    batch = batch_of(samples, n)  # 12 >= 11: request ids "req_k_10" and "req_k_11" sort before "req_k_2"
    assert sum(map(len, batch)) > 2 * BATCHED_TOKENS  # so prefills are cut into chunks across steps
    return batch


def max_abs_diff(results, batch, reference) -> float:
    worst = 0.0
    for ids, result in zip(batch, results):
        for got, want in zip(result["hidden_states"], reference.sample_states(ids)):
            worst = max(worst, (got - want).abs().max().item())
    return worst


# ----------------------------------------------------------------------------- the engine itself


def test_engine_runs_on_the_platform_vllm_detects(gen):
    config = gen.vllm_config
    assert isinstance(gen.executor, MultiprocExecutor)
    assert config.device_config.device_type == current_platform.device_type != ""
    assert config.parallel_config.worker_extension_cls == "draftsmith.extraction.vllm_backend.CaptureWorkerExtension"
    assert config.model_config.dtype == torch.float32 and config.model_config.enforce_eager
    assert config.cache_config.num_gpu_blocks == gen.scheduler.kv_cache_config.num_blocks > 0
    worker = gen.executor.collective_rpc(lambda self: f"{type(self.worker).__module__}.{type(self.worker).__name__}")[0]
    runner = gen.executor.collective_rpc(lambda self: type(self.model_runner).__name__)[0]
    if current_platform.is_cpu():
        assert "cpu_worker" in worker and runner == "CPUModelRunner", (worker, runner)


# ----------------------------------------------------------------------------- (a) states equal the hf backend's


def test_vllm_shard_equals_the_hf_shard(gen, target, samples_path, samples, tmp_path, record_property):
    manifest = vllm_shard(gen, target, samples_path, samples, tmp_path / "vllm")
    extract_shard(samples, sha256_file(samples_path), 0, 2, tmp_path / "hf",
                  hf_backend(target, AUX, HFHiddenStateExtractor(str(target), AUX, "cpu", DTYPE), 2048, 16),
                  model_fingerprint(target))
    validate_shard(tmp_path / "vllm", samples, deep=True)
    hf_manifest = validate_shard(tmp_path / "hf", samples, deep=True)
    assert manifest["vllm"]["fixes_applied"] == compat.FIX_NAMES
    for key in ("format", "layer_ids", "layer_convention", "hidden_size", "num_states", "dtype", "num_samples", "num_tokens"):
        assert manifest[key] == hf_manifest[key], key
    assert manifest["num_tokens"] > 4 * BATCHED_TOKENS  # chunked prefills happened
    worst = 0.0
    for ours, theirs in zip(manifest["samples"], hf_manifest["samples"]):
        a = torch.load(tmp_path / "vllm" / ours["file"], weights_only=True)
        b = torch.load(tmp_path / "hf" / theirs["file"], weights_only=True)
        assert ours["index"] == theirs["index"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape
            worst = max(worst, (x - y).abs().max().item())
    record_property("max_abs_diff_vs_hf", worst)
    print(f"max |vllm - hf| over {manifest['num_samples']} samples, {manifest['num_tokens']} tokens, 4 states: {worst:.3g}")
    assert worst <= ATOL


# ----------------------------------------------------------------------------- (b) each fix the engine exercises


def test_chunked_prefills_complete_only_with_the_fix(gen, samples, reference):
    batch = chunked_batch(samples)
    results = gen.generate(batch)
    assert [r["input_ids"].tolist() for r in results] == batch
    assert max_abs_diff(results, batch, reference) <= ATOL
    with compat.disabled("complete_chunked_prefills"), pytest.raises(CaptureError, match="prefill cut short"):
        gen.generate(batch)


def test_pairing_by_position_silently_mixes_samples_on_the_real_runner(gen, samples):
    """The model runner's batch rows are not in submission order (finished requests leave slots that new ones fill):
    speculators' offset slicing hands samples another sample's states, and raises nothing."""
    batch = chunked_batch(samples)
    with compat.disabled("request_id_pairing"):
        results = gen.generate(batch)
    wrong = [i for i, (r, ids) in enumerate(zip(results, batch)) if r["input_ids"].tolist() != ids]
    assert wrong, "the runner kept submission order; this batch does not show the pairing problem"
    assert [r["input_ids"].tolist() for r in gen.generate(batch)] == batch  # paired by request id


def test_extraction_refuses_the_states_that_position_pairing_returns(gen, target, samples_path, samples, tmp_path):
    with compat.disabled("request_id_pairing"), pytest.raises(ShardError, match="token ids"):
        vllm_shard(gen, target, samples_path, samples, tmp_path / "shard_0")
    assert not (tmp_path / "shard_0" / "manifest.json").exists()


def test_execute_model_needs_sample_tokens(gen, samples):
    batch = chunked_batch(samples)
    with compat.disabled("sample_after_execute"), pytest.raises(RuntimeError, match="'sample_after_execute' is off"):
        gen.generate(batch)
    reset_engine(gen)
    # speculators' loop (execute, abort, execute): the worker's own state check refuses the second step
    with compat.disabled("sample_after_execute", "complete_chunked_prefills"), \
            pytest.raises(RuntimeError, match=r"sample_tokens\(\) must be called after execute_model\(\) returns None"):
        gen.generate(batch)


def test_collective_rpc_returns_one_reply_for_unique_reply_rank(gen, samples):
    per_rank = gen.executor.collective_rpc("draftsmith_take_capture")
    single = gen.executor.collective_rpc("draftsmith_take_capture", unique_reply_rank=0)
    assert per_rank == [[]] and single == []  # a list per rank, or rank 0's reply itself
    with compat.disabled("rpc_single_reply"), pytest.raises(CaptureError, match="capture reply is a dict"):
        gen.generate(batch_of(samples, 2))


def real_kv_cache_inputs(gen):
    spec = gen.executor.collective_rpc("get_kv_cache_spec")[0]  # from the worker's loaded model
    return spec, _get_kv_cache_groups_uniform_spec(spec), min(gen.executor.determine_available_memory())


def test_kv_cache_config_from_the_workers_specs(gen):
    spec, groups, available = real_kv_cache_inputs(gen)
    kv = get_kv_cache_config_from_groups(**compat.kv_cache_config_kwargs(gen.vllm_config, groups, spec, available))
    assert kv.num_blocks == gen.scheduler.kv_cache_config.num_blocks
    with compat.disabled("kv_cache_config_signature"), pytest.raises(TypeError, match="kv_cache_specs"):
        get_kv_cache_config_from_groups(**compat.kv_cache_config_kwargs(gen.vllm_config, groups, spec, available))


def test_scheduler_needs_block_size(gen):
    kv = gen.scheduler.kv_cache_config
    scheduler = Scheduler(**compat.scheduler_kwargs(gen.vllm_config, kv, StructuredOutputManager(vllm_config=gen.vllm_config)))
    assert scheduler.block_size == gen.scheduler.block_size == gen.vllm_config.cache_config.block_size
    with compat.disabled("scheduler_block_size"), pytest.raises(TypeError, match="block_size"):
        Scheduler(**compat.scheduler_kwargs(gen.vllm_config, kv, StructuredOutputManager(vllm_config=gen.vllm_config)))


def test_scheduler_config_needs_is_encoder_decoder(target):
    assert build_vllm_config(str(target), MAX_MODEL_LEN, dtype=DTYPE).model_config.max_model_len == MAX_MODEL_LEN
    with compat.disabled("scheduler_config_is_encoder_decoder"), pytest.raises(Exception, match="is_encoder_decoder"):
        build_vllm_config(str(target), MAX_MODEL_LEN, dtype=DTYPE)


def test_prefix_caching_breaks_the_generators_requests(gen, target, samples):
    """With prefix caching on (vLLM's default), the generator's requests carry no block hashes: the real Scheduler
    trips on them before anything runs."""
    assert gen.vllm_config.cache_config.enable_prefix_caching is False
    with compat.disabled("prefix_caching_off"):
        config = build_vllm_config(str(target), MAX_MODEL_LEN, dtype=DTYPE, max_num_seqs=16,
                                   max_num_batched_tokens=BATCHED_TOKENS)
    assert config.cache_config.enable_prefix_caching is True
    config.cache_config.num_gpu_blocks = gen.vllm_config.cache_config.num_gpu_blocks
    caching = Scheduler(**compat.scheduler_kwargs(config, gen.scheduler.kv_cache_config,
                                                  StructuredOutputManager(vllm_config=config)))
    own, gen.scheduler = gen.scheduler, caching
    try:
        with pytest.raises(AssertionError):  # KVCacheManager: len(request.block_hashes) >= num_full_blocks
            gen.generate(batch_of(samples, 2))
    finally:
        gen.scheduler = own


def test_async_scheduling_is_off_on_the_cpu_platform_either_way(target):
    """`synchronous_scheduling` is the one driver-side fix this engine cannot exercise: vLLM's CPU platform turns
    asynchronous scheduling off itself (CpuPlatform.check_and_update_config). On CUDA, VllmConfig turns it on."""
    with compat.disabled("synchronous_scheduling"):
        config = build_vllm_config(str(target), MAX_MODEL_LEN, dtype=DTYPE)
    assert config.scheduler_config.async_scheduling is (not current_platform.is_cpu())
    assert build_vllm_config(str(target), MAX_MODEL_LEN, dtype=DTYPE).scheduler_config.async_scheduling is False
