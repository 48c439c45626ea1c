"""Every vLLM call and worker attribute the vllm extraction backend uses, checked against the installed code."""

from __future__ import annotations

import os
from dataclasses import dataclass

from draftsmith.vllm_stack.compat import (
    active,
    cache_config_kwargs,
    kv_cache_config_kwargs,
    scheduler_config_kwargs,
    scheduler_kwargs,
)
from draftsmith.vllm_stack.probes import CACHE_CONFIG, EXECUTOR, KV_CACHE_FROM_GROUPS, REQUEST, SCHEDULER, SCHEDULER_CONFIG
from draftsmith.vllm_stack.source import module_path, params


@dataclass(frozen=True)
class CallSite:
    name: str
    module: str
    qualname: str
    arguments: list[str]  # keyword arguments draftsmith passes (with the active fixes)


def call_sites() -> list[CallSite]:
    """Every vLLM call the vllm extraction backend makes, with the arguments it passes under the active fixes."""
    placeholder = type("Placeholder", (), {"cache_config": type("C", (), {"block_size": 16})(),
                                            "parallel_config": object()})()
    return [
        CallSite("ModelConfig", "vllm.config.model", "ModelConfig",
                 ["model", "tokenizer", "trust_remote_code", "revision", "tokenizer_revision", "dtype", "max_model_len",
                  "enforce_eager"]),
        CallSite("CacheConfig", *CACHE_CONFIG, list(cache_config_kwargs(16, 0.9))),
        CallSite("ParallelConfig", "vllm.config.parallel", "ParallelConfig", ["tensor_parallel_size", "worker_extension_cls"]),
        CallSite("SchedulerConfig", *SCHEDULER_CONFIG, list(scheduler_config_kwargs(2048, 32, 8192))),
        CallSite("DeviceConfig", "vllm.config.device", "DeviceConfig", ["device"]),
        CallSite("VllmConfig", "vllm.config.vllm", "VllmConfig",
                 ["model_config", "cache_config", "parallel_config", "scheduler_config", "device_config", "load_config"]),
        CallSite("MultiprocExecutor", *EXECUTOR, ["vllm_config"]),
        CallSite("collective_rpc", EXECUTOR[0], f"{EXECUTOR[1]}.collective_rpc", ["method", "args", "unique_reply_rank"]),
        CallSite("execute_model", EXECUTOR[0], f"{EXECUTOR[1]}.execute_model", ["scheduler_output"]),
        *([CallSite("sample_tokens", EXECUTOR[0], f"{EXECUTOR[1]}.sample_tokens", ["grammar_output"])]
          if active("sample_after_execute") else []),
        CallSite("determine_available_memory", "vllm.v1.executor.abstract", "Executor.determine_available_memory", []),
        CallSite("initialize_from_config", "vllm.v1.executor.abstract", "Executor.initialize_from_config",
                 ["kv_cache_configs"]),
        CallSite("unify_hybrid_kv_cache_specs", "vllm.v1.core.kv_cache_utils", "unify_hybrid_kv_cache_specs",
                 ["kv_cache_spec"]),
        CallSite("_get_kv_cache_groups_uniform_spec", "vllm.v1.core.kv_cache_utils", "_get_kv_cache_groups_uniform_spec",
                 ["kv_cache_specs"]),
        CallSite("get_kv_cache_config_from_groups", *KV_CACHE_FROM_GROUPS,
                 list(kv_cache_config_kwargs(None, None, None, 0))),
        CallSite("StructuredOutputManager", "vllm.v1.structured_output", "StructuredOutputManager", ["vllm_config"]),
        CallSite("Scheduler", *SCHEDULER, list(scheduler_kwargs(placeholder, None, None))),
        CallSite("Scheduler.add_request", SCHEDULER[0], f"{SCHEDULER[1]}.add_request", ["request"]),
        CallSite("Scheduler.schedule", SCHEDULER[0], f"{SCHEDULER[1]}.schedule", []),
        CallSite("Scheduler.get_grammar_bitmask", SCHEDULER[0], f"{SCHEDULER[1]}.get_grammar_bitmask", ["scheduler_output"]),
        CallSite("Scheduler.update_from_output", SCHEDULER[0], f"{SCHEDULER[1]}.update_from_output",
                 ["scheduler_output", "model_runner_output"]),
        CallSite("Request", *REQUEST,
                 ["request_id", "prompt_token_ids", "sampling_params", "pooling_params", "eos_token_id", "arrival_time"]),
        CallSite("SamplingParams", "vllm.sampling_params", "SamplingParams", ["max_tokens", "temperature"]),
    ]


def check_call_sites() -> list[tuple[CallSite, list[str]]]:
    """Each call site with the problems binding its arguments to the installed signature (empty: it binds)."""
    results = []
    for site in call_sites():
        p = params(site.module, site.qualname)
        problems = [f"{site.module}.{site.qualname} does not exist in the installed code"] if p is None else p.bind(site.arguments)
        results.append((site, problems))
    return results


# The model-runner state CaptureWorkerExtension reads at each step (vLLM's V1 GPU model runner).
WORKER_ATTRIBUTES = [
    ("vllm.v1.worker.gpu_model_runner", "self.input_ids = "),
    ("vllm.v1.worker.gpu_model_runner", "self.query_start_loc = "),
    ("vllm.v1.worker.gpu_input_batch", "self.num_computed_tokens_cpu = "),
    ("vllm.v1.worker.gpu_input_batch", "def req_ids("),
    ("vllm.v1.worker.gpu_input_batch", "def num_reqs("),
]


def check_worker_attributes() -> list[str]:
    """Problems with the worker-side attributes the capture relies on (empty when all exist)."""
    problems = []
    for module, text in WORKER_ATTRIBUTES:
        path = module_path(module)
        if path is None or text not in path.read_text():
            problems.append(f"{module} has no `{text.strip()}`")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") not in ("", "0"):
        problems.append("VLLM_USE_V2_MODEL_RUNNER is set; the capture reads the V1 GPU model runner's batch layout")
    return problems
