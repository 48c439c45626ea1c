"""Fixed-address decoding state: a static KV cache and CUDA-graph replay (the benchmark's batch-1 loops; the
batched decoder and BatchKV of draftsmith.decoding.batch, and the benchmark's batched loops on them, build on the same
pieces).

At batch 1 an eager decode step of a small model is launch-bound: hundreds of kernel launches from
Python cost far more than the kernels. A step whose tensors all live at fixed addresses (the KV cache
preallocated, the write position a device scalar, the mask computed on the device) can be captured
once as a CUDA graph and replayed with one launch. The same step functions run eagerly on the CPU,
so the tests check the captured code's arithmetic there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from draftsmith.target_model.layers import text_config


class StaticKV:
    """A preallocated KV cache for Hugging Face attention layers (their `update(key, value, layer_idx, kwargs)`),
    written at `cache_kwargs["cache_position"]`; always returns the whole buffers, so the caller's attention mask
    must hide every slot past the sequence (stale entries of a rewound step stay there until overwritten)."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, cache_kwargs: dict | None = None):
        if layer_idx not in self.keys:
            shape = (*key.shape[:2], self.max_length, key.shape[3])
            self.keys[layer_idx] = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self.values[layer_idx] = torch.zeros(shape, dtype=value.dtype, device=value.device)
        position = cache_kwargs["cache_position"]
        self.keys[layer_idx].index_copy_(2, position, key)
        self.values[layer_idx].index_copy_(2, position, value)
        return self.keys[layer_idx], self.values[layer_idx]


def positions_and_mask(length: torch.Tensor, q: int, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions length..length+q-1 ([q]) of q new tokens after `length` cached ones (a device scalar [1]) and
    their boolean SDPA mask over the whole static cache ([1, 1, q, max_length], True = attend)."""
    positions = length + torch.arange(q, device=length.device)
    keys = torch.arange(max_length, device=length.device)
    return positions, (keys[None, :] <= positions[:, None]).view(1, 1, q, max_length)


def prompt_bucket(length: int, smallest: int = 16) -> int:
    """The padded length a prompt of `length` tokens is captured at: the next power of two, at least `smallest`
    (so a benchmark captures a handful of prompt shapes rather than one per prompt length)."""
    return max(smallest, 1 << (length - 1).bit_length())


def prompt_buckets(longest: int) -> list[int]:
    """Every bucket a prompt of 1..`longest` tokens is padded to, ascending (what a warm-up captures)."""
    return sorted({prompt_bucket(n) for n in range(1, longest + 1)})


class CapturedStep:
    """`fn(*inputs)` captured as a CUDA graph on static copies of `example_inputs`; calling it copies new inputs
    (same shapes) in and replays. Its outputs are static too: read or copy them before the next replay."""

    def __init__(self, fn: Callable, example_inputs: list[torch.Tensor]):
        self.inputs = [x.clone() for x in example_inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph (lazy initialisation, kernel selection)
            for _ in range(2):
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
        if not self.enabled:
            return fn(*inputs)
        if key not in self.steps:
            # the warm-up runs `fn` for real, so steps must be idempotent: state writes at positions the inputs set
            self.steps[key] = CapturedStep(fn, list(inputs))
        return self.steps[key](*inputs)

    def clear(self) -> None:
        self.steps.clear()


def reserved(cache: StaticKV | None, capacity: int, graphs: StepGraphs, granule: int = 256) -> StaticKV:
    """`cache` if it holds `capacity` positions, else a new one of `capacity` rounded up to a granule (so that it
    grows in steps rather than per sequence), dropping `graphs`: they address the old buffers."""
    if cache is not None and capacity <= cache.max_length:
        return cache
    graphs.clear()
    return StaticKV(-(-capacity // granule) * granule)


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
