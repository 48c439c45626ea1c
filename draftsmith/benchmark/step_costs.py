"""What one draft step costs next to one target step, at batch 1 (and with N rows at once): the cost ratio c.

With acceptance length tau and k draft steps per round, the cost model tau / (1 + k * c) says how
many times as fast as target-only decoding speculative decoding runs when a round costs only k
draft steps and one decode step. The benchmark reports c and that figure beside the measured
speedup: the gap between them is overhead of the loop (host syncs, Python per round, the
verification step's extra width). It is a model, not a strict bound: tau counts each prompt's
forward, which yields one token, so the speedup after the first token can exceed it.
Each timed call is synchronised on its own, as the decoding loops see it.

On a GPU each step's kernels are counted too (`kernels`: one call profiled, a graph's replay included; the most
costly by name): at batch 1 a step of a small model is bound by its kernels' count more than by their arithmetic, so
where a verification costs more than a target step, its extra kernels are named there.
"""

from __future__ import annotations

import statistics
import time

import torch

from draftsmith.decoding.engine_proposers import BatchEagle3Proposer
from draftsmith.decoding.batch_target import BatchTarget
from draftsmith.decoding.engine import serve_length
from draftsmith.decoding.sampling import Sampling
from draftsmith.decoding.trace import synchronize

REPEATS = 20
TOP_KERNELS = 8


def median_ms(fn, device, repeats: int = REPEATS) -> float:
    """Median ms of `repeats` calls of `fn` after one warm-up call (where a graph is captured), each synchronised on
    its own."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def kernel_profile(fn, top: int = TOP_KERNELS) -> dict:
    """The CUDA kernels (and copies) one call of `fn` runs, after a warm-up call: their count and total microseconds,
    and the `top` names by time with their calls and microseconds."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list] = {}
    for event in kernels:
        calls_us = by_name.setdefault(event.name, [0, 0.0])
        calls_us[0] += 1
        calls_us[1] += event.time_range.elapsed_us()
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"count": len(kernels), "us": sum(us for _, us in by_name.values()),
            "top": [{"name": name, "calls": calls, "us": us} for name, (calls, us) in ranked]}


@torch.inference_mode()
def measure_step_costs(target: BatchTarget, proposer: BatchEagle3Proposer, prompt_ids: list[int], k: int,
                       rows: int = 1) -> dict:
    """Median times (ms) of a target decode step, a verification step over k + 1 tokens and one draft step (a draft
    round of k steps / k, one newly verified position per round) after `prompt_ids`, in `rows` rows of the engine
    at once (each holding the prompt), run as its rounds run them (CUDA graphs where the target and proposer use
    them), and of a refill: a new request (the prompt again) into one row while the others keep theirs, the target's
    prefill, its first token read and the draft's prefill, as `serve` admits it. Under load about rows x tokens a
    round / answer length requests end every round, each one such refill. On a GPU also each one's kernels (the
    draft's: a whole round's)."""
    length = serve_length([prompt_ids], REPEATS + 2 + k + 1, k)  # draft rounds each add one verified position
    target.begin(rows, length)
    proposer.begin(rows, length)
    everyone = list(range(rows))
    prompts, logits = target.prefill(everyone, [prompt_ids] * rows, with_aux=True)
    # as serve admits a request: its rows then decode (a ragged step reads a row's slots from its start only then)
    token = target.first_tokens(everyone, logits, Sampling(), [0] * rows)
    proposer.prefill(everyone, prompts, token)
    aux_last = prompts.aux[:, prompts.last : prompts.last + 1].clone()  # the target's outputs are rewritten by its steps

    def target_step():  # the engine's forward writes at the row's next slot and leaves it there: every call alike
        target.forward(token[:, None])[0].argmax().item()

    def verify_step():
        target.forward(token[:, None].repeat(1, k + 1), with_aux=True)[0].argmax(-1).tolist()

    proposer.propose([], k)  # consumes the prompt's last position; each round below adds one

    def draft_round():
        proposer.accept(token[:, None], aux_last, [1] * rows)
        proposer.propose([], k)[0].tolist()

    def refill():
        admitted, first_logits = target.prefill([0], [prompt_ids], with_aux=True)
        first = target.first_tokens([0], first_logits, Sampling(), [0])
        proposer.prefill([0], admitted, first)
        first.tolist()

    target_ms = median_ms(target_step, target.device)
    verify_ms = median_ms(verify_step, target.device)
    draft_ms = median_ms(draft_round, target.device) / k
    refill_ms = median_ms(refill, target.device)  # last: it starts row 0's request over
    costs = {"target_step_ms": target_ms, "verify_step_ms": verify_ms, "draft_step_ms": draft_ms,
             "cost_ratio": draft_ms / target_ms, "refill_ms": refill_ms}
    if target.device.type == "cuda":
        costs["kernels"] = {name: kernel_profile(fn) for name, fn in
                            (("target_step", target_step), ("verify_step", verify_step), ("draft_round", draft_round),
                             ("refill", refill))}
    return costs
