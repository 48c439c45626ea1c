"""speculators 0.3.0's vLLM extraction code, made to run on the installed vLLM (0.16.0 in production).

speculators 0.3.0 was written against vLLM 0.11. Each incompatibility is a named `Fix`: what
breaks without it and how that shows on a cluster, what draftsmith does instead, and a
`probe` (draftsmith.vllm_stack.probes) that reads the *installed* code and says whether the fix
applies there. The helpers below are what draftsmith's generator calls; each does speculators'
original thing where its fix does not apply (or is disabled for a test), and the fixed thing
otherwise. Nothing here edits site-packages.

draftsmith.vllm_stack.call_sites checks every vLLM call the backend makes against the installed signatures.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator

from draftsmith.vllm_stack import probes
from draftsmith.vllm_stack.probes import SCHEDULER, SCHEDULER_CONFIG, Probe

# ----------------------------------------------------------------------------- the fixes


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
        "pass the configured target.trust_remote_code to the tokenizer, AutoConfig and ModelConfig", probes.probe_tokenizer),
    Fix("scheduler_config_is_encoder_decoder",
        "SchedulerConfig(...) raises a validation error: is_encoder_decoder is a required InitVar",
        "pass is_encoder_decoder from the ModelConfig", lambda: probes.probe_required_param(SCHEDULER_CONFIG, "is_encoder_decoder"),
        call_site="SchedulerConfig"),
    Fix("scheduler_block_size",
        "Scheduler(...) raises TypeError: missing required argument 'block_size'",
        "pass the KV-cache block size (times the context-parallel sizes, as EngineCore does)",
        lambda: probes.probe_required_param(SCHEDULER, "block_size"), call_site="Scheduler"),
    Fix("kv_cache_config_signature",
        "get_kv_cache_config_from_groups(...) raises TypeError: unexpected keyword argument 'kv_cache_specs'",
        "pass only the arguments the installed signature takes", probes.probe_kv_cache_specs,
        call_site="get_kv_cache_config_from_groups"),
    Fix("prefix_caching_off",
        "prefix caching is on by default; requests built without a block_hasher trip "
        "`assert len(request.block_hashes) >= num_full_blocks`, and a prefix-cache hit would skip the forward "
        "pass (and so the hidden states) of the cached tokens",
        "build the CacheConfig with enable_prefix_caching=False: extraction needs every token computed",
        probes.probe_prefix_caching),
    Fix("synchronous_scheduling",
        "VllmConfig turns asynchronous scheduling on when unset, which the generator's one-step-at-a-time loop "
        "with the plain Scheduler does not drive",
        "build the SchedulerConfig with async_scheduling=False", probes.probe_async_scheduling),
    Fix("sample_after_execute",
        "execute_model() returns None and the next execute_model() raises 'sample_tokens() must be called after "
        "execute_model() returns None'",
        "call sample_tokens() when execute_model() returns None, as EngineCore.step does", probes.probe_sample_tokens),
    Fix("complete_chunked_prefills",
        "aborting every request after its first scheduler step cuts chunked prefills short once a batch exceeds "
        "max_num_batched_tokens: those samples get fewer states than tokens and every later sample is misaligned",
        "feed each step's output back with scheduler.update_from_output() and step until every request finishes "
        "(max_tokens=1 ends it after its last prefill chunk)", probes.probe_chunked_prefill),
    Fix("rpc_single_reply",
        "collective_rpc(..., unique_reply_rank=0) returns one object, not a list, so `[0]` keeps only the first "
        "layer's tensor and the samples are cut from it silently",
        "use the reply as it is when the installed collective_rpc returns a single result", probes.probe_rpc_reply),
    Fix("request_id_pairing",
        "results are paired with samples by position; any reordering of the batch (request ids that sort "
        "lexicographically put req_10 before req_2 once a batch has 11 or more) pairs states with the wrong loss mask",
        "the worker keys captured chunks by request id and position; the driver pairs by request id and checks "
        "the echoed token ids against the input", probes.probe_request_pairing),
    Fix("embed_input_ids",
        "speculators' worker replaces the decoder's forward with its own loop that calls get_input_embeddings "
        "(renamed embed_input_ids in vLLM 0.16): AttributeError after the model has loaded",
        "capture with forward hooks around the model's own forward, so the model's own embedding call (and its "
        "own layer arguments) are used", probes.probe_embed_input_ids, side="worker"),
    Fix("decoder_location",
        "speculators' worker takes the decoder at `model.model`; multimodal wrappers (Kimi-K2.5) keep it at "
        "`model.language_model.model`",
        "locate it with draftsmith.target_model.layers.find_decoder (language_model.model, then model), which names the class "
        "when neither exists", probes.probe_decoder_location, side="worker"),
    Fix("aux_layer_convention",
        "speculators 0.3.0 captures the state after layer i and the last layer before the final norm, one layer "
        "away from the state vLLM feeds an EAGLE-3 draft when serving",
        "capture the state entering layer i (vLLM's serving convention) and the output of the final norm",
        probes.probe_layer_convention, side="worker"),
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
