"""Probes: each reads the *installed* code (signatures, dataclass fields, method names, and the source of speculators'
own generator and worker) and says whether one of draftsmith.vllm_stack.compat's fixes applies there, with the evidence.

They read source files (draftsmith.vllm_stack.source) instead of importing them, so preflight answers in seconds
and needs neither torch nor vLLM's compiled extension. Where a module is not installed, its probe says so and
answers "not needed".
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from draftsmith.vllm_stack.source import (
    calls_in,
    field_default,
    find_def,
    has_method,
    params,
    parse_module,
    registry_archs,
    source_of,
)

# where speculators' generator and worker, and the vLLM classes the backend calls, live
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"
SCHEDULER_CONFIG = ("vllm.config.scheduler", "SchedulerConfig")
CACHE_CONFIG = ("vllm.config.cache", "CacheConfig")
SCHEDULER = ("vllm.v1.core.sched.scheduler", "Scheduler")
KV_CACHE_FROM_GROUPS = ("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups")
EXECUTOR = ("vllm.v1.executor.multiproc_executor", "MultiprocExecutor")
REQUEST = ("vllm.v1.request", "Request")


@dataclass(frozen=True)
class Probe:
    """A probe's answer: whether the fix applies to the installed code, and the evidence."""

    needed: bool
    evidence: str


def missing(what: str) -> Probe:
    return Probe(False, f"{what} is not installed; nothing to fix")


def probe_tokenizer() -> Probe:
    calls = [c for c in calls_in(GENERATOR, "VllmHiddenStatesGenerator.__init__")
             if ast.unparse(c.func) == "AutoTokenizer.from_pretrained"]
    if parse_module(GENERATOR) is None:
        return missing("speculators' VllmHiddenStatesGenerator")
    if not calls:
        return Probe(False, "speculators' generator no longer loads a tokenizer itself")
    passes = any(kw.arg == "trust_remote_code" for c in calls for kw in c.keywords)
    return Probe(not passes, f"speculators calls `{ast.unparse(calls[0])}`"
                 + ("" if passes else " (no trust_remote_code; AutoConfig and ModelConfig get trust_remote_code=True)"))


def probe_required_param(location: tuple[str, str], name: str) -> Probe:
    p = params(*location)
    if p is None:
        return missing(".".join(location))
    if name in p.required:
        return Probe(True, f"{p.where} takes {name!r}" + (" (required)" if p.required[name] else ""))
    return Probe(False, f"{p.where} takes no {name!r}")


def probe_kv_cache_specs() -> Probe:
    p = params(*KV_CACHE_FROM_GROUPS)
    if p is None:
        return missing(".".join(KV_CACHE_FROM_GROUPS))
    names = ", ".join(p.required)
    if "kv_cache_specs" in p.required:
        return Probe(False, f"{p.where}({names}) still takes kv_cache_specs")
    return Probe(True, f"{p.where}({names}) takes no kv_cache_specs")


def probe_prefix_caching() -> Probe:
    if parse_module(CACHE_CONFIG[0]) is None:
        return missing("vllm")
    try:
        default = field_default(*CACHE_CONFIG, "enable_prefix_caching")
    except KeyError:
        return Probe(False, "CacheConfig has no enable_prefix_caching")
    hasher = params(*REQUEST)
    takes_hasher = hasher is not None and "block_hasher" in hasher.required
    return Probe(default is True, f"CacheConfig.enable_prefix_caching defaults to {default!r}"
                 + ("; Request takes a block_hasher that the generator does not build" if takes_hasher else ""))


def probe_async_scheduling() -> Probe:
    p = params(*SCHEDULER_CONFIG)
    if p is None:
        return missing("vllm")
    if "async_scheduling" not in p.required:
        return Probe(False, "SchedulerConfig has no async_scheduling")
    default = field_default(*SCHEDULER_CONFIG, "async_scheduling")
    default = ast.unparse(default) if isinstance(default, ast.AST) else repr(default)
    return Probe(True, f"SchedulerConfig.async_scheduling defaults to {default} (VllmConfig decides when unset)")


def probe_sample_tokens() -> Probe:
    if parse_module(EXECUTOR[0]) is None:
        return missing("vllm")
    if has_method(*EXECUTOR, "sample_tokens"):
        return Probe(True, "MultiprocExecutor has sample_tokens(); execute_model() may return None until it is called")
    return Probe(False, "MultiprocExecutor has no sample_tokens(); execute_model() returns the output")


def probe_chunked_prefill() -> Probe:
    if parse_module(SCHEDULER_CONFIG[0]) is None:
        return missing("vllm")
    chunked = field_default(*SCHEDULER_CONFIG, "enable_chunked_prefill")
    aborts = "FINISHED_ABORTED" in source_of(GENERATOR, "VllmHiddenStatesGenerator.generate")
    return Probe(chunked is True and aborts,
                 f"SchedulerConfig.enable_chunked_prefill defaults to {chunked!r}; speculators' generate() "
                 + ("aborts every request after its first scheduled step" if aborts else "does not abort requests"))


def probe_rpc_reply() -> Probe:
    node = find_def(EXECUTOR[0], f"{EXECUTOR[1]}.collective_rpc")
    if node is None:
        return missing("vllm's MultiprocExecutor.collective_rpc")
    doc = ast.get_docstring(node) or ""
    p = params(EXECUTOR[0], f"{EXECUTOR[1]}.collective_rpc")
    single = "unique_reply_rank" in p.required and "single result" in doc
    indexes = "[0]" in source_of(GENERATOR, "VllmHiddenStatesGenerator.generate")
    return Probe(single and indexes, f"collective_rpc docstring: {doc.splitlines()[0] if doc else '(none)'!r}; "
                 f"speculators indexes the reply with [0]: {indexes}")


def probe_embed_input_ids() -> Probe:
    llama = ("vllm.model_executor.models.llama", "LlamaModel")
    if parse_module(llama[0]) is None:
        return missing("vllm")
    calls_old = "get_input_embeddings" in source_of(WORKER, "_patched_forward")
    has_old = has_method(*llama, "get_input_embeddings")
    has_new = has_method(*llama, "embed_input_ids")
    return Probe(calls_old and not has_old,
                 f"speculators' worker calls get_input_embeddings: {calls_old}; vLLM LlamaModel has "
                 f"get_input_embeddings: {has_old}, embed_input_ids: {has_new}")


def probe_decoder_location() -> Probe:
    setup = source_of(WORKER, "HiddenStatesWorkerExtension._setup_hidden_states_capture")
    if not setup:
        return missing("speculators' custom worker")
    if "model.model" not in setup:
        return Probe(False, "speculators' worker does not take the decoder at model.model")
    wrappers = [k for k in registry_archs("_MULTIMODAL_MODELS") if k.startswith("KimiK25")]
    evidence = "speculators' worker takes the decoder at `model.model`"
    if wrappers:
        evidence += f"; vLLM registers multimodal wrappers such as {wrappers[0]} (decoder at model.language_model.model)"
    return Probe(True, evidence)


def probe_layer_convention() -> Probe:
    fn = find_def(WORKER, "_patched_forward")
    if fn is None:
        return missing("speculators' custom worker")
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)):
        text = [ast.unparse(s) for s in loop.body]
        layer_call = next((i for i, t in enumerate(text) if "layer(" in t), None)
        capture = next((i for i, t in enumerate(text) if "aux_hidden_states.append" in t), None)
        if layer_call is not None and capture is not None:
            after = capture > layer_call
            return Probe(after, "speculators' worker captures the state " + ("after" if after else "entering")
                         + " decoder layer i, and the last layer before the final norm")
    return Probe(False, "speculators' worker capture loop not found")


def probe_request_pairing() -> Probe:
    src = source_of(GENERATOR, "VllmHiddenStatesGenerator.generate")
    if not src:
        return missing("speculators' VllmHiddenStatesGenerator")
    by_offset = "offset" in src and "request_id" not in src.split("_get_captured_states")[-1]
    return Probe(by_offset, "speculators slices the concatenated captured states by position (offset) in input order"
                 if by_offset else "speculators pairs results by request id")


# ----------------------------------------------------------------------------- the CPU test worker

# draftsmith.vllm_stack.cpu_spec_worker (a test harness): vLLM's worker-class option names it by this path
CPU_TEST_WORKER = "draftsmith.vllm_stack.cpu_spec_worker.CPUSpecDecodeWorker"
CPU_RUNNER = ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner")
GPU_RUNNER = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
REJECTION = "vllm.v1.sample.rejection_sampler"
EAGLE = ("vllm.v1.spec_decode.eagle", "SpecDecodeBaseProposer")


@dataclass(frozen=True)
class CpuSpecFix:
    name: str
    needed: bool
    evidence: str


def _cpu_spec_fix(name: str, module: str, qualname: str, needed, found: str, not_found: str) -> CpuSpecFix:
    """A probe of the source of `module.qualname`: `needed(source)` says whether the worker's change applies."""
    src = source_of(module, qualname)
    if not src:
        return CpuSpecFix(name, False, f"{module}.{qualname} is not installed")
    applies = bool(needed(src))
    return CpuSpecFix(name, applies, f"{qualname} {found if applies else not_found}")


def _spec_decode_assertion(src: str) -> str | None:
    """The assertion in `src` that refuses a speculative config, as source text."""
    asserts = [ast.unparse(n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Assert)
               and "speculative_config" in ast.unparse(n.test)]
    return asserts[0] if asserts else None


def cpu_spec_decode_fixes() -> list[CpuSpecFix]:
    """What the installed vLLM needs from the test-only CPU worker to run speculative decoding on its CPU platform,
    read from its source without importing it. `cpu_runner_assertion.needed`: vLLM's own CPU worker refuses it."""
    init = source_of(CPU_RUNNER[0], f"{CPU_RUNNER[1]}.__init__")
    assertion = _spec_decode_assertion(init) if init else None
    return [
        _cpu_spec_fix("cpu_runner_assertion", CPU_RUNNER[0], f"{CPU_RUNNER[1]}.__init__", lambda _: assertion,
                      f"refuses speculative decoding: `{assertion}`", "accepts a speculative config"),
        _cpu_spec_fix("cpu_runner_loads_drafter", CPU_RUNNER[0], f"{CPU_RUNNER[1]}.load_model", lambda s: "drafter" not in s,
                      "loads the target only", "loads the drafter"),
        _cpu_spec_fix("draft_copy_without_cuda_stream", GPU_RUNNER[0], f"{GPU_RUNNER[1]}._copy_draft_token_ids_to_cpu",
                      lambda s: "torch.cuda.stream" in s, "copies on a CUDA stream", "uses no CUDA stream"),
        _cpu_spec_fix("greedy_rejection_in_torch", REJECTION, "rejection_sample", lambda s: "rejection_greedy_sample_kernel[" in s,
                      "launches the Triton kernel rejection_greedy_sample_kernel", "launches no greedy Triton kernel"),
        _cpu_spec_fix("unpadded_drafter_batch", EAGLE[0], f"{EAGLE[1]}.prepare_inputs_padded", lambda s: "_kernel[" in s,
                      "(the padded drafter batch) launches a Triton kernel", "launches no Triton kernel"),
    ]
