"""speculators 0.3.0's vLLM extraction code, made to run on the installed vLLM (0.16.0 in production).

speculators 0.3.0 was written against vLLM 0.11. Each incompatibility is a named `Fix`: what
breaks without it and how that shows on a cluster, what draftsmith does instead, and a
`probe` that reads the *installed* code (signatures, class fields, method names, and the
source of speculators' own generator) and says whether the fix applies there. The helpers
below are what draftsmith's generator calls; each does speculators' original thing where
its fix does not apply (or is disabled for a test), and the fixed thing otherwise. Nothing
here edits site-packages.

The probes read source files (draftsmith.vllm_stack.source) instead of importing them, so
preflight answers in seconds; draftsmith.vllm_stack.call_sites checks every vLLM call the
backend makes against the installed signatures.
"""

from __future__ import annotations

import ast
import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

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

# ----------------------------------------------------------------------------- the fixes

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


def _missing(what: str) -> Probe:
    return Probe(False, f"{what} is not installed; nothing to fix")


def _probe_tokenizer() -> Probe:
    calls = [c for c in calls_in(GENERATOR, "VllmHiddenStatesGenerator.__init__")
             if ast.unparse(c.func) == "AutoTokenizer.from_pretrained"]
    if parse_module(GENERATOR) is None:
        return _missing("speculators' VllmHiddenStatesGenerator")
    if not calls:
        return Probe(False, "speculators' generator no longer loads a tokenizer itself")
    passes = any(kw.arg == "trust_remote_code" for c in calls for kw in c.keywords)
    return Probe(not passes, f"speculators calls `{ast.unparse(calls[0])}`"
                 + ("" if passes else " (no trust_remote_code; AutoConfig and ModelConfig get trust_remote_code=True)"))


def _probe_required_param(location: tuple[str, str], name: str) -> Probe:
    p = params(*location)
    if p is None:
        return _missing(".".join(location))
    if name in p.required:
        return Probe(True, f"{p.where} takes {name!r}" + (" (required)" if p.required[name] else ""))
    return Probe(False, f"{p.where} takes no {name!r}")


def _probe_kv_cache_specs() -> Probe:
    p = params(*KV_CACHE_FROM_GROUPS)
    if p is None:
        return _missing(".".join(KV_CACHE_FROM_GROUPS))
    names = ", ".join(p.required)
    if "kv_cache_specs" in p.required:
        return Probe(False, f"{p.where}({names}) still takes kv_cache_specs")
    return Probe(True, f"{p.where}({names}) takes no kv_cache_specs")


def _probe_prefix_caching() -> Probe:
    if parse_module(CACHE_CONFIG[0]) is None:
        return _missing("vllm")
    try:
        default = field_default(*CACHE_CONFIG, "enable_prefix_caching")
    except KeyError:
        return Probe(False, "CacheConfig has no enable_prefix_caching")
    hasher = params(*REQUEST)
    takes_hasher = hasher is not None and "block_hasher" in hasher.required
    return Probe(default is True, f"CacheConfig.enable_prefix_caching defaults to {default!r}"
                 + ("; Request takes a block_hasher that the generator does not build" if takes_hasher else ""))


def _probe_async_scheduling() -> Probe:
    p = params(*SCHEDULER_CONFIG)
    if p is None:
        return _missing("vllm")
    if "async_scheduling" not in p.required:
        return Probe(False, "SchedulerConfig has no async_scheduling")
    default = field_default(*SCHEDULER_CONFIG, "async_scheduling")
    default = ast.unparse(default) if isinstance(default, ast.AST) else repr(default)
    return Probe(True, f"SchedulerConfig.async_scheduling defaults to {default} (VllmConfig decides when unset)")


def _probe_sample_tokens() -> Probe:
    if parse_module(EXECUTOR[0]) is None:
        return _missing("vllm")
    if has_method(*EXECUTOR, "sample_tokens"):
        return Probe(True, "MultiprocExecutor has sample_tokens(); execute_model() may return None until it is called")
    return Probe(False, "MultiprocExecutor has no sample_tokens(); execute_model() returns the output")


def _probe_chunked_prefill() -> Probe:
    if parse_module(SCHEDULER_CONFIG[0]) is None:
        return _missing("vllm")
    chunked = field_default(*SCHEDULER_CONFIG, "enable_chunked_prefill")
    aborts = "FINISHED_ABORTED" in source_of(GENERATOR, "VllmHiddenStatesGenerator.generate")
    return Probe(chunked is True and aborts,
                 f"SchedulerConfig.enable_chunked_prefill defaults to {chunked!r}; speculators' generate() "
                 + ("aborts every request after its first scheduled step" if aborts else "does not abort requests"))


def _probe_rpc_reply() -> Probe:
    node = find_def(EXECUTOR[0], f"{EXECUTOR[1]}.collective_rpc")
    if node is None:
        return _missing("vllm's MultiprocExecutor.collective_rpc")
    doc = ast.get_docstring(node) or ""
    p = params(EXECUTOR[0], f"{EXECUTOR[1]}.collective_rpc")
    single = "unique_reply_rank" in p.required and "single result" in doc
    indexes = "[0]" in source_of(GENERATOR, "VllmHiddenStatesGenerator.generate")
    return Probe(single and indexes, f"collective_rpc docstring: {doc.splitlines()[0] if doc else '(none)'!r}; "
                 f"speculators indexes the reply with [0]: {indexes}")


def _probe_embed_input_ids() -> Probe:
    llama = ("vllm.model_executor.models.llama", "LlamaModel")
    if parse_module(llama[0]) is None:
        return _missing("vllm")
    calls_old = "get_input_embeddings" in source_of(WORKER, "_patched_forward")
    has_old = has_method(*llama, "get_input_embeddings")
    has_new = has_method(*llama, "embed_input_ids")
    return Probe(calls_old and not has_old,
                 f"speculators' worker calls get_input_embeddings: {calls_old}; vLLM LlamaModel has "
                 f"get_input_embeddings: {has_old}, embed_input_ids: {has_new}")


def _probe_decoder_location() -> Probe:
    setup = source_of(WORKER, "HiddenStatesWorkerExtension._setup_hidden_states_capture")
    if not setup:
        return _missing("speculators' custom worker")
    if "model.model" not in setup:
        return Probe(False, "speculators' worker does not take the decoder at model.model")
    wrappers = [k for k in registry_archs("_MULTIMODAL_MODELS") if k.startswith("KimiK25")]
    evidence = "speculators' worker takes the decoder at `model.model`"
    if wrappers:
        evidence += f"; vLLM registers multimodal wrappers such as {wrappers[0]} (decoder at model.language_model.model)"
    return Probe(True, evidence)


def _probe_layer_convention() -> Probe:
    fn = find_def(WORKER, "_patched_forward")
    if fn is None:
        return _missing("speculators' custom worker")
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)):
        text = [ast.unparse(s) for s in loop.body]
        layer_call = next((i for i, t in enumerate(text) if "layer(" in t), None)
        capture = next((i for i, t in enumerate(text) if "aux_hidden_states.append" in t), None)
        if layer_call is not None and capture is not None:
            after = capture > layer_call
            return Probe(after, "speculators' worker captures the state " + ("after" if after else "entering")
                         + " decoder layer i, and the last layer before the final norm")
    return Probe(False, "speculators' worker capture loop not found")


def _probe_request_pairing() -> Probe:
    src = source_of(GENERATOR, "VllmHiddenStatesGenerator.generate")
    if not src:
        return _missing("speculators' VllmHiddenStatesGenerator")
    by_offset = "offset" in src and "request_id" not in src.split("_get_captured_states")[-1]
    return Probe(by_offset, "speculators slices the concatenated captured states by position (offset) in input order"
                 if by_offset else "speculators pairs results by request id")


@dataclass(frozen=True)
class Fix:
    name: str
    problem: str  # what breaks without the fix, as it shows on a cluster
    remedy: str  # what draftsmith does instead
    probe: Callable[[], Probe]
    side: str = "driver"  # where it runs: "driver" (the generator's process) or "worker" (each vLLM GPU worker)
    call_site: str | None = None  # the call site (below) whose arguments this fix changes


FIXES: list[Fix] = [
    Fix("tokenizer_trust_remote_code",
        "speculators loads the tokenizer without trust_remote_code, so a target with a remote-code tokenizer "
        "(Kimi-K2.5) fails after the executor starts; it also hard-codes trust_remote_code=True for the config and model",
        "pass the configured target.trust_remote_code to the tokenizer, AutoConfig and ModelConfig", _probe_tokenizer),
    Fix("scheduler_config_is_encoder_decoder",
        "SchedulerConfig(...) raises a validation error: is_encoder_decoder is a required InitVar",
        "pass is_encoder_decoder from the ModelConfig", lambda: _probe_required_param(SCHEDULER_CONFIG, "is_encoder_decoder"),
        call_site="SchedulerConfig"),
    Fix("scheduler_block_size",
        "Scheduler(...) raises TypeError: missing required argument 'block_size'",
        "pass the KV-cache block size (times the context-parallel sizes, as EngineCore does)",
        lambda: _probe_required_param(SCHEDULER, "block_size"), call_site="Scheduler"),
    Fix("kv_cache_config_signature",
        "get_kv_cache_config_from_groups(...) raises TypeError: unexpected keyword argument 'kv_cache_specs'",
        "pass only the arguments the installed signature takes", _probe_kv_cache_specs,
        call_site="get_kv_cache_config_from_groups"),
    Fix("prefix_caching_off",
        "prefix caching is on by default; requests built without a block_hasher trip "
        "`assert len(request.block_hashes) >= num_full_blocks`, and a prefix-cache hit would skip the forward "
        "pass (and so the hidden states) of the cached tokens",
        "build the CacheConfig with enable_prefix_caching=False: extraction needs every token computed",
        _probe_prefix_caching),
    Fix("synchronous_scheduling",
        "VllmConfig turns asynchronous scheduling on when unset, which the generator's one-step-at-a-time loop "
        "with the plain Scheduler does not drive",
        "build the SchedulerConfig with async_scheduling=False", _probe_async_scheduling),
    Fix("sample_after_execute",
        "execute_model() returns None and the next execute_model() raises 'sample_tokens() must be called after "
        "execute_model() returns None'",
        "call sample_tokens() when execute_model() returns None, as EngineCore.step does", _probe_sample_tokens),
    Fix("complete_chunked_prefills",
        "aborting every request after its first scheduler step cuts chunked prefills short once a batch exceeds "
        "max_num_batched_tokens: those samples get fewer states than tokens and every later sample is misaligned",
        "feed each step's output back with scheduler.update_from_output() and step until every request finishes "
        "(max_tokens=1 ends it after its last prefill chunk)", _probe_chunked_prefill),
    Fix("rpc_single_reply",
        "collective_rpc(..., unique_reply_rank=0) returns one object, not a list, so `[0]` keeps only the first "
        "layer's tensor and the samples are cut from it silently",
        "use the reply as it is when the installed collective_rpc returns a single result", _probe_rpc_reply),
    Fix("request_id_pairing",
        "results are paired with samples by position; any reordering of the batch (request ids that sort "
        "lexicographically put req_10 before req_2 once a batch has 11 or more) pairs states with the wrong loss mask",
        "the worker keys captured chunks by request id and position; the driver pairs by request id and checks "
        "the echoed token ids against the input", _probe_request_pairing),
    Fix("embed_input_ids",
        "speculators' worker replaces the decoder's forward with its own loop that calls get_input_embeddings "
        "(renamed embed_input_ids in vLLM 0.16): AttributeError after the model has loaded",
        "capture with forward hooks around the model's own forward, so the model's own embedding call (and its "
        "own layer arguments) are used", _probe_embed_input_ids, side="worker"),
    Fix("decoder_location",
        "speculators' worker takes the decoder at `model.model`; multimodal wrappers (Kimi-K2.5) keep it at "
        "`model.language_model.model`",
        "locate it with draftsmith.target_model.layers.find_decoder (language_model.model, then model), which names the class "
        "when neither exists", _probe_decoder_location, side="worker"),
    Fix("aux_layer_convention",
        "speculators 0.3.0 captures the state after layer i and the last layer before the final norm, one layer "
        "away from the state vLLM feeds an EAGLE-3 draft when serving",
        "capture the state entering layer i (vLLM's serving convention) and the output of the final norm",
        _probe_layer_convention, side="worker"),
]
FIX_NAMES = [f.name for f in FIXES]

_disabled: set[str] = set()


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Run a block with some fixes off (speculators' original behaviour) in this process, to show what each fix
    prevents. vLLM's worker processes always apply theirs."""
    unknown = set(names) - set(FIX_NAMES)
    if unknown:
        raise KeyError(f"unknown fixes {sorted(unknown)}; known: {FIX_NAMES}")
    saved = set(_disabled)
    _disabled.update(names)
    try:
        yield
    finally:
        _disabled.clear()
        _disabled.update(saved)


@functools.lru_cache(maxsize=None)
def probe(name: str) -> Probe:
    fix = next(f for f in FIXES if f.name == name)
    try:
        return fix.probe()
    except Exception as e:  # noqa: BLE001 - a probe that cannot read the code must say so, not crash preflight
        return Probe(True, f"probe failed ({type(e).__name__}: {e}); applying the fix")


def active(name: str) -> bool:
    """Whether draftsmith applies this fix now: the installed code needs it and it is not disabled."""
    if name not in FIX_NAMES:
        raise KeyError(f"unknown fix {name!r}")
    return name not in _disabled and probe(name).needed


def fix_report() -> list[dict]:
    return [{"name": f.name, "side": f.side, "needed": probe(f.name).needed, "applied": active(f.name),
             "evidence": probe(f.name).evidence, "problem": f.problem, "remedy": f.remedy} for f in FIXES]


# ----------------------------------------------------------------------------- what the generator calls


def tokenizer_kwargs(trust_remote_code: bool, revision: str | None = None) -> dict:
    if active("tokenizer_trust_remote_code"):
        return {"trust_remote_code": trust_remote_code, "revision": revision}
    return {}


def model_trust_remote_code(trust_remote_code: bool) -> bool:
    """trust_remote_code for AutoConfig and ModelConfig (speculators 0.3.0 hard-codes True)."""
    return trust_remote_code if active("tokenizer_trust_remote_code") else True


def cache_config_kwargs(block_size: int, gpu_memory_utilization: float) -> dict:
    kwargs = {"block_size": block_size, "gpu_memory_utilization": gpu_memory_utilization}
    if active("prefix_caching_off"):
        kwargs["enable_prefix_caching"] = False
    return kwargs


def scheduler_config_kwargs(max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
                            is_encoder_decoder: bool = False) -> dict:
    kwargs = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
              "max_num_batched_tokens": max_num_batched_tokens}
    if active("scheduler_config_is_encoder_decoder"):
        kwargs["is_encoder_decoder"] = is_encoder_decoder
    if active("synchronous_scheduling"):
        kwargs["async_scheduling"] = False
    return kwargs


def scheduler_block_size(vllm_config) -> int:
    parallel = vllm_config.parallel_config
    return (vllm_config.cache_config.block_size * getattr(parallel, "decode_context_parallel_size", 1)
            * getattr(parallel, "prefill_context_parallel_size", 1))


def scheduler_kwargs(vllm_config, kv_cache_config, structured_output_manager) -> dict:
    kwargs = {"vllm_config": vllm_config, "kv_cache_config": kv_cache_config,
              "structured_output_manager": structured_output_manager}
    if active("scheduler_block_size"):
        kwargs["block_size"] = scheduler_block_size(vllm_config)
    return kwargs


def kv_cache_config_kwargs(vllm_config, kv_cache_groups, kv_cache_specs, available_memory: int) -> dict:
    kwargs = {"vllm_config": vllm_config, "kv_cache_groups": kv_cache_groups, "available_memory": available_memory}
    if not active("kv_cache_config_signature"):
        kwargs["kv_cache_specs"] = kv_cache_specs
    return kwargs


def rpc_rank0(executor, method: str, *args):
    """The reply of TP rank 0 to a collective RPC."""
    reply = executor.collective_rpc(method, args=args, unique_reply_rank=0)
    return reply if active("rpc_single_reply") else reply[0]


def step(executor, scheduler, scheduler_output) -> None:
    """Execute one scheduled step and hand its output back to the scheduler (EngineCore.step's order)."""
    output = executor.execute_model(scheduler_output)
    if output is None and active("sample_after_execute"):
        output = executor.sample_tokens(scheduler.get_grammar_bitmask(scheduler_output))
    if active("complete_chunked_prefills"):
        if output is None:
            raise RuntimeError("execute_model() returned None and sample_tokens() was not called; "
                               "the fix 'sample_after_execute' is off")
        scheduler.update_from_output(scheduler_output, output)
    else:  # speculators 0.3.0: abort whatever was scheduled, finished or not
        from vllm.v1.request import RequestStatus

        for req_id in scheduler_output.num_scheduled_tokens:
            scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)


def locate_decoder(model):
    """The decoder stack (with .layers and .norm) of a vLLM model, inside multimodal wrappers too."""
    from draftsmith.target_model.layers import find_decoder

    return find_decoder(model) if active("decoder_location") else model.model
