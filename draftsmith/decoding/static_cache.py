"""CUDA-graph replay of decoding steps (`StepGraphs`: captured per shape), the prompt buckets a prefill is padded to,
and what a model must be for draftsmith to keep its KV cache static (the engine: draftsmith.decoding.engine.serve over
BatchKV).

A decode step of a small model is launch-bound: hundreds of kernel launches from Python cost far more than the
kernels. A step whose tensors all live at fixed addresses (the KV cache preallocated, the write slots device
tensors, the mask computed on the device) can be captured once as a CUDA graph and replayed with one launch. The same
step functions run eagerly on the CPU, so the tests check the captured code's arithmetic there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftsmith.target_model.layers import text_config


def prompt_bucket(length: int, smallest: int = 16) -> int:
    """The padded length a prompt of `length` tokens is captured at: the next power of two, at least `smallest`
    (so a benchmark captures a handful of prompt shapes rather than one per prompt length)."""
    return max(smallest, 1 << (length - 1).bit_length())


class CapturedStep:
    """`fn(*inputs)` captured as a CUDA graph on static copies of `example_inputs`; calling it copies new inputs (same
    shapes) in and replays. Its outputs are static too: read or copy them before the next replay. The capture runs
    `fn` twice for real first (WARM_UP_RUNS), so a step that advances state must count them."""

    WARM_UP_RUNS = 2

    def __init__(self, fn: Callable, example_inputs: list[torch.Tensor]):
        self.inputs = [x.clone() for x in example_inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy initialisation, kernel selection)
            for _ in range(self.WARM_UP_RUNS):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        for static, x in zip(self.inputs, inputs):
            static.copy_(x)
        self.graph.replay()
        return self.outputs


class StepGraphs:
    """Captured steps keyed by their shape; `run` captures on a key's first call, or runs `fn` eagerly when off."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.steps: dict = {}

    def run(self, key, fn: Callable, *inputs: torch.Tensor):
        """`fn(*inputs)`, replayed from its capture under `key` (captured on the key's first call: its warm-up runs
        `fn` for real, so a step must be idempotent, its state writes at positions the inputs set, or count them)."""
        if not self.enabled:
            return fn(*inputs)
        if key not in self.steps:
            self.steps[key] = CapturedStep(fn, list(inputs))
        return self.steps[key](*inputs)

    def first_call_runs(self, key) -> int:
        """The runs of its function beyond the one that a call under `key` makes now: a first capture's warm-up."""
        return CapturedStep.WARM_UP_RUNS if self.enabled and key not in self.steps else 0


def full_attention_sdpa(model) -> bool:
    """Whether every layer attends to the whole prefix through SDPA: then draftsmith builds the masks itself
    and can keep the KV cache static (no sliding windows, whose masks transformers must build)."""
    config = text_config(model.config)
    return (getattr(model.config, "_attn_implementation", None) == "sdpa"
            and not getattr(config, "sliding_window", None)
            and "sliding_attention" not in (getattr(config, "layer_types", None) or []))
