"""CUDA-graph replay of decoding steps (`StepGraphs`: captured per shape, optionally under the fastest kernel
setting), the attention span a step reads, the prompt buckets a prefill is padded to, and what a model must be for
draftsmith to keep its KV cache static (the engine: draftsmith.decoding.engine.serve over BatchKV).

A decode step of a small model is launch-bound: hundreds of kernel launches from Python cost far more than the
kernels. A step whose tensors all live at fixed addresses (the KV cache preallocated, the write slots device
tensors, the mask computed on the device) can be captured once as a CUDA graph and replayed with one launch. The same
step functions run eagerly on the CPU, so the tests check the captured code's arithmetic there.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from draftsmith.target_model.layers import text_config

log = logging.getLogger(__name__)

# What a tuned capture tries (name, BLAS library, SDPA backend; None: PyTorch's choice), PyTorch's defaults first.
# At a few tokens a step, a small model's GEMMs are matrix-vector shaped: cuBLAS and cuBLASLt may pick different
# kernels for them, and the SDPA backends differ too. On one H100 SmolLM2-135M's steps kept PyTorch's defaults (cuBLAS
# ran the same GEMM kernels at 1 and 4 tokens; a verification's extra cost is elsewhere), its draft's rounds gained 2%
# (docs/BENCHMARKS.md).
KERNEL_SETTINGS = [(f"{blas} + {sdpa_name}", blas, sdpa)
                   for sdpa_name, sdpa in (("default SDPA", None), ("efficient SDPA", SDPBackend.EFFICIENT_ATTENTION),
                                           ("cuDNN SDPA", SDPBackend.CUDNN_ATTENTION))
                   for blas in ("cublas", "cublaslt")]
TUNING_MARGIN = 0.02  # another setting must be this much faster than the best so far to replace it (noise)


SPAN_GRANULE = 128  # a step attends to the first `span` slots of its cache, a multiple of this: one captured graph each


def attention_span(needed: int, max_length: int) -> int:
    """The slots a step attends to when its sequence fills the first `needed`: `needed` rounded up to SPAN_GRANULE,
    at most the whole cache. SDPA with a mask reads every slot it is given, padding or not, and more so at several
    queries: on one H100 SmolLM2's 4-token verification cost 0.53 ms more than a one-token step over 768 slots, 0.31
    ms more over 256 (docs/BENCHMARKS.md, "SmolLM2-135M on MT-Bench at batch 1"), so a step reads no more of the cache than it needs."""
    return min(max_length, -(-needed // SPAN_GRANULE) * SPAN_GRANULE)


def prompt_bucket(length: int, smallest: int = 16) -> int:
    """The padded length a prompt of `length` tokens is captured at: the next power of two, at least `smallest`
    (so a benchmark captures a handful of prompt shapes rather than one per prompt length)."""
    return max(smallest, 1 << (length - 1).bit_length())


def prompt_buckets(longest: int) -> list[int]:
    """Every bucket a prompt of 1..`longest` tokens is padded to, ascending (what a warm-up captures)."""
    return sorted({prompt_bucket(n) for n in range(1, longest + 1)})


class CapturedStep:
    """`fn(*inputs)` captured as a CUDA graph on static copies of `example_inputs` (its memory from `pool` where
    given: graphs that never run at once can share one); calling it copies new inputs (same shapes) in and replays.
    Its outputs are static too: read or copy them before the next replay. The capture runs `fn` twice for real first
    (WARM_UP_RUNS), so a step that advances state must count them."""

    WARM_UP_RUNS = 2

    def __init__(self, fn: Callable, example_inputs: list[torch.Tensor], pool=None):
        self.inputs = [x.clone() for x in example_inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy initialisation, kernel selection)
            for _ in range(self.WARM_UP_RUNS):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        self.graph.replay()
        return self.outputs


@contextlib.contextmanager
def kernel_setting(blas: str | None, sdpa: SDPBackend | None):
    """GEMMs from `blas` (cublas or cublaslt) and attention from the SDPA backend `sdpa` inside (None: PyTorch's
    choice); a captured graph keeps the kernels chosen while it was captured."""
    previous = torch.backends.cuda.preferred_blas_library()
    if blas is not None:
        torch.backends.cuda.preferred_blas_library(blas)
    try:
        with sdpa_kernel(sdpa) if sdpa is not None else contextlib.nullcontext():
            yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def replay_ms(step: Callable[[], object], replays: int = 20, rounds: int = 3) -> float:
    """The fastest of `rounds` mean times (ms) of `replays` back-to-back calls of `step` (on CUDA, the device's
    time: synchronised before and after each round)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    best = float("inf")
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(replays):
            step()
        sync()
        best = min(best, 1000 * (time.perf_counter() - start) / replays)
    return best


def fastest_setting(build: Callable[[], object], timer: Callable[[object], float], settings=KERNEL_SETTINGS):
    """The fastest of `settings`: `build()`, called under each setting, makes a step with its kernels (a setting
    whose kernels cannot run the step raises RuntimeError and is skipped), `timer(step)` times it. Returns the
    winner's name, its step and the ms of every setting (None where it could not run)."""
    best, times = None, {}
    for name, blas, sdpa in settings:
        try:
            with kernel_setting(blas, sdpa):
                step = build()
        except RuntimeError as e:  # e.g. no SDPA kernel of that backend for these shapes
            log.debug("kernel setting %s cannot run this step: %s", name, str(e).splitlines()[0])
            times[name] = None
            continue
        times[name] = ms = timer(step)
        if best is None or ms < best[2] * (1 - TUNING_MARGIN):
            best = (name, step, ms)
    if best is None:
        raise RuntimeError(f"no kernel setting of {[s[0] for s in settings]} can run this step")
    return best[0], best[1], times


class StepGraphs:
    """Captured steps keyed by their shape; `run` captures on a key's first call, or runs `fn` eagerly when off.
    With `tune`, a first call captures the step once per kernel setting (`KERNEL_SETTINGS`) and keeps the fastest
    replay; `choices` names each key's setting and `timings` holds every setting's ms."""

    def __init__(self, enabled: bool, tune: bool = False):
        self.enabled = enabled
        self.tune = enabled and tune
        self.steps: dict = {}
        self.choices: dict = {}
        self.timings: dict = {}

    def run(self, key, fn: Callable, *inputs: torch.Tensor, tune: bool = True, family=None):
        """`fn(*inputs)`, replayed from its capture under `key`; `tune=False` captures it with PyTorch's kernel
        choices even when tuning (a step run once per prompt is not worth timing every setting for). Steps of one
        `family` (default: the key; e.g. one width at several attention spans) share the setting tuned on the first
        of them: the others are captured with it, untimed."""
        if not self.enabled:
            return fn(*inputs)
        if key not in self.steps:
            # the warm-up runs `fn` for real, so steps must be idempotent: state writes at positions the inputs set
            family = key if family is None else family
            if self.tune and tune and family in self.choices:
                _, blas, sdpa = next(s for s in KERNEL_SETTINGS if s[0] == self.choices[family])
                with kernel_setting(blas, sdpa):
                    self.steps[key] = CapturedStep(fn, list(inputs))
            elif self.tune and tune:
                name, self.steps[key], self.timings[family] = fastest_setting(
                    lambda: CapturedStep(fn, list(inputs)), timer=lambda step: replay_ms(step.graph.replay))
                self.choices[family] = name
            else:
                self.steps[key] = CapturedStep(fn, list(inputs))
        return self.steps[key](*inputs)

    def clear(self) -> None:
        self.steps.clear()

    def described_choices(self) -> dict[str, str]:
        """Each tuned step's kernel setting, keyed by its step key as text (for a summary)."""
        return {" ".join(map(str, key if isinstance(key, tuple) else (key,))): name
                for key, name in self.choices.items()}


def full_attention_sdpa(model) -> bool:
    """Whether every layer attends to the whole prefix through SDPA: then draftsmith builds the masks itself
    and can keep the KV cache static (no sliding windows, whose masks transformers must build)."""
    config = text_config(model.config)
    return (getattr(model.config, "_attn_implementation", None) == "sdpa"
            and not getattr(config, "sliding_window", None)
            and "sliding_attention" not in (getattr(config, "layer_types", None) or []))


def keeps_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (then a step computes only the logits it reads)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters
