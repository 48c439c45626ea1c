"""The eager reference decoder of the offline benchmark (batch 1, transformers' DynamicCache) and what the engine
shares with it: the target with its auxiliary-layer hooks (`TargetModel`), a request's `Trace`, the stopping rule.

The engine, draftsmith.benchmark.batch_spec.serve, decodes at batch 1 and under load alike over static caches and
CUDA graphs. These loops are its reference: the tests hold its tokens and its accepted drafts equal to theirs, and the
benchmark runs them for a target whose masks draftsmith cannot build (sliding windows, non-SDPA attention).

Speculative round (temperature 0): the proposer drafts up to k tokens; the target runs once over [last token, drafts]
with its KV cache; drafts are accepted while they equal the target's argmax, and the target's own token at the first
mismatch (or after the last draft) is appended as the bonus token. Every emitted token is the target's argmax, so the
output equals target-only greedy decoding up to floating-point ties. Generation stops after `max_new_tokens` tokens or
at the first stop token (kept in the output), whichever comes first. The reference proposers are
draftsmith.benchmark.proposers.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from draftsmith.decoding.static_cache import full_attention_sdpa, keeps_logits
from draftsmith.target_model.layers import find_decoder


@dataclass
class Trace:
    """What one decoding run did. `proposed[r]`/`accepted[r]`: draft tokens of verification round r."""

    tokens: list[int]
    target_forwards: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    first_token_seconds: float | None = None  # from the start to the first token on the host (the prompt's forward)
    # per request under load (draftsmith.benchmark.batch_spec.serve): from its admission to its first token, and the
    # time per output token after it; one request alone: the first token's time and the rest's time per token
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None

    def counts(self, k: int) -> dict:
        """Row fields of `draftsmith.benchmark.results` (rounds without a proposal are not drafts)."""
        if any(p > k for p in self.proposed):
            raise ValueError(f"a round proposed more than k={k} draft tokens: {max(self.proposed)}")
        if any(a > p for a, p in zip(self.accepted, self.proposed)):
            raise ValueError("a round accepted more draft tokens than it proposed")
        row = {
            "new_tokens": len(self.tokens),
            "target_forwards": self.target_forwards,
            "drafts": sum(1 for p in self.proposed if p > 0),
            "draft_tokens": sum(self.proposed),
            "accepted_tokens": sum(self.accepted),
            "seconds": self.seconds,
            "first_token_seconds": self.first_token_seconds,
            **self.latency(),
        }
        for i in range(1, k + 1):
            row[f"accept_pos_{i}"] = sum(1 for a in self.accepted if a >= i)
        return row

    def latency(self) -> dict:
        """The request's time to its first token and time per output token after it (alone: its own times)."""
        if self.ttft_seconds is not None:
            return {"ttft_seconds": self.ttft_seconds, "tpot_seconds": self.tpot_seconds}
        first = self.first_token_seconds
        after = (self.seconds - first) / (len(self.tokens) - 1) if first is not None and len(self.tokens) > 1 else None
        return {"ttft_seconds": first, "tpot_seconds": after}


def cut_output(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The shared stopping rule: at most max_new_tokens, ending at the first stop token (kept)."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def answer_done(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """Whether an answer of `tokens` is over once `new` (its latest tokens) are added: the stopping rule."""
    return len(tokens) >= max_new_tokens or any(t in stop_ids for t in new)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def causal_mask(past: int, q: int, device) -> torch.Tensor:
    """Boolean SDPA mask [1, 1, q, past + q] for q new positions after `past` cached ones (True = attend)."""
    keys = torch.arange(past + q, device=device)
    return (keys[None, :] <= keys[past:, None]).view(1, 1, q, past + q)


class TargetModel:
    """A Hugging Face causal LM with hooks on its auxiliary decoder layers (`call` returns their inputs beside the
    logits), decoding one sequence eagerly over transformers' DynamicCache (`start`, `forward`, `rewind`: the
    reference loops). `static`: whether its masks are draftsmith's to build (full-attention SDPA), so that the engine
    (BatchTarget) can keep its cache static."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.aux_layer_ids = list(aux_layer_ids or [])
        self._capturing = False
        self._captured: dict[int, torch.Tensor] = {}
        decoder = find_decoder(model)
        for layer_id in self.aux_layer_ids:
            decoder.layers[layer_id].register_forward_pre_hook(self._hook(layer_id), with_kwargs=True)
        self._keeps_logits = keeps_logits(model)
        self.static = full_attention_sdpa(model)
        self.cache: DynamicCache | None = None
        self.length = 0  # positions in the cache

    def _hook(self, layer_id: int):
        def hook(_module, args, kwargs):
            if self._capturing:
                self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    def start(self, prompt_ids: list[int], with_aux: bool = False, keep: int = 1):
        """A new sequence: run the prompt. Returns the last `keep` positions' logits and, with `with_aux`, the
        prompt's auxiliary states."""
        self.cache, self.length = DynamicCache(), 0
        return self.forward(torch.tensor([prompt_ids], device=self.device), keep=keep, with_aux=with_aux)

    def rewind(self, length: int) -> None:
        """Forget every position from `length` on."""
        self.cache.crop(length)
        self.length = length

    def forward(self, input_ids: torch.Tensor, keep: int, with_aux: bool = False):
        """Run `input_ids` [1, q] after the cached positions. Returns the logits of the last `keep` positions [keep, V]
        and, with `with_aux`, the auxiliary states [1, q, 3H]."""
        if with_aux and not self.aux_layer_ids:
            raise ValueError("this TargetModel was built without auxiliary layer ids")
        logits, aux = self.call(keep, with_aux, input_ids=input_ids, past_key_values=self.cache)
        self.length += input_ids.shape[1]
        return logits[0], aux

    def call(self, keep: int | torch.Tensor, with_aux: bool, **model_kwargs):
        """The model's forward (`model_kwargs`: inputs, mask, cache) keeping the last `keep` positions' logits
        ([B, keep, V]; a tensor of positions: those) and, with `with_aux`, the auxiliary layers' inputs ([B, q, 3H];
        else None). The engine (draftsmith.benchmark.batch_spec) calls it too, for the same hooks."""
        self._captured.clear()
        self._capturing = with_aux
        extra = {"logits_to_keep": keep} if self._keeps_logits else {}
        try:
            out = self.model(**model_kwargs, use_cache=True, **extra)
        finally:
            self._capturing = False
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1) if with_aux else None
        if self._keeps_logits:
            return out.logits, aux
        return (out.logits[:, keep] if isinstance(keep, torch.Tensor) else out.logits[:, -keep:]), aux


@torch.inference_mode()
def greedy_decode(target: TargetModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Trace:
    """Target-only greedy decoding, one target forward per token."""
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    logits, _ = target.start(prompt_ids)
    next_token = logits[-1].argmax()
    tokens = [int(next_token)]  # the host must see each token to apply the stopping rule
    first_token_seconds = time.perf_counter() - start
    while not answer_done(tokens, tokens[-1:], max_new_tokens, stop_ids):
        logits, _ = target.forward(next_token.view(1, 1), keep=1)
        next_token = logits[-1].argmax()
        tokens.append(int(next_token))
    synchronize(device)
    return Trace(tokens=tokens, target_forwards=len(tokens), seconds=time.perf_counter() - start,
                 first_token_seconds=first_token_seconds)


@torch.inference_mode()
def speculative_decode(target: TargetModel, proposer, prompt_ids: list[int], k: int, max_new_tokens: int,
                       stop_ids: set[int]) -> Trace:
    """Greedy speculative decoding with `proposer` (one of draftsmith.benchmark.proposers)."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    logits, aux = target.start(prompt_ids, with_aux=proposer.needs_aux)
    prompt = torch.tensor(prompt_ids, device=device)
    last = logits[-1].argmax().view(1)
    tokens = [int(last)]
    trace = Trace(tokens=tokens, target_forwards=1, first_token_seconds=time.perf_counter() - start)
    context = list(prompt_ids) + tokens  # host copy for n-gram lookup
    proposer.start(torch.cat([prompt[1:], last]), aux)
    done = answer_done(tokens, tokens, max_new_tokens, stop_ids)
    while not done:
        draft = proposer.propose(context, k)
        m = int(draft.shape[0])
        logits, aux = target.forward(torch.cat([last, draft]).view(1, -1), keep=m + 1, with_aux=proposer.needs_aux)
        trace.target_forwards += 1
        verified = logits.argmax(-1)  # [m + 1]: the target's token after each input position
        both = torch.cat([draft, verified]).tolist()  # the one host sync of the round
        drafted, target_tokens = both[:m], both[m:]
        accepted = 0
        while accepted < m and drafted[accepted] == target_tokens[accepted]:
            accepted += 1
        new = target_tokens[: accepted + 1]
        trace.proposed.append(m)
        trace.accepted.append(accepted)
        tokens += new
        context += new
        target.rewind(len(prompt_ids) + len(tokens) - 1)  # keep everything but the bonus token
        last = verified[accepted : accepted + 1]
        proposer.accept(verified[: accepted + 1], aux[:, : accepted + 1] if aux is not None else None)
        done = answer_done(tokens, new, max_new_tokens, stop_ids)
    synchronize(device)
    trace.seconds = time.perf_counter() - start
    trace.tokens = cut_output(tokens, max_new_tokens, stop_ids)
    return trace


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where `tokens` differs from `reference` (None: neither leaves the other)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


@torch.inference_mode()
def divergence_gap(target: TargetModel, prompt_ids: list[int], tokens: list[int], reference: list[int]) -> dict | None:
    """Where a speculative output first leaves the greedy `reference`: its position, both tokens, and the target's
    logit of the greedy token minus that of the emitted one, from one forward over the prompt and the shared prefix.
    A gap near 0 is a near-tie that rounding in a low-precision dtype can flip; a large one is a decoding error."""
    i = first_divergence(tokens, reference)
    if i is None or i >= len(tokens) or i >= len(reference):
        return None if i is None else {"position": i, "greedy_token": None, "emitted_token": None, "logit_gap": None}
    context = list(prompt_ids) + reference[:i]
    logits, _ = target.start(context)
    row = logits[-1].float()
    return {"position": i, "greedy_token": reference[i], "emitted_token": tokens[i],
            "logit_gap": float(row[reference[i]] - row[tokens[i]])}
