"""Greedy decoding loops of the offline benchmark: target-only, prompt lookup, EAGLE-3 chain drafts.

All methods share one verification loop and one stopping rule, so their outputs are
comparable token for token: generation stops after `max_new_tokens` tokens or at the first
stop token (kept in the output), whichever comes first.

Speculative round (batch size 1, temperature 0): the proposer drafts up to k tokens; the
target runs once over [last token, drafts] with its KV cache; drafts are accepted while they
equal the target's argmax, and the target's own token at the first mismatch (or after the
last draft) is appended as the bonus token. Every emitted token is the target's argmax, so
the output equals target-only greedy decoding up to floating-point ties. The same rounds for several prompts
decoded together are draftsmith.benchmark.batch_spec.

The proposers (prompt lookup, EAGLE-3 chain drafts) are draftsmith.benchmark.proposers.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from draftsmith.decoding.static_cache import (
    SPAN_GRANULE,
    StaticKV,
    StepGraphs,
    attention_span,
    full_attention_sdpa,
    keeps_logits,
    positions_and_mask,
    prompt_bucket,
    prompt_buckets,
    reserved,
)
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
    """A Hugging Face causal LM decoding one sequence at a time with a KV cache, capturing the inputs of the
    auxiliary decoder layers.

    For full-attention SDPA models the cache is static (`StaticKV`, its own masks) and, with `cuda_graphs`,
    every step of up to `MAX_GRAPH_WIDTH` tokens is replayed as a CUDA graph, and so is each prompt, padded to
    a power-of-two bucket (`prompt_bucket`: the padding's cache slots lie past the prompt, masked until the next
    steps overwrite them); other models decode eagerly with transformers' DynamicCache. A static step attends to
    the cache's first slots only, as many as its sequence needs in multiples of SPAN_GRANULE (`attention_span`; one
    capture per span; `whole_cache`: always all of them). Every path gives the same tokens
    (tests/test_spec_decode.py). With `tune_kernels` each decoding step (not a prompt's) is captured under every
    kernel setting and replayed with the fastest (`StepGraphs`; the spans of one width share its setting)."""

    MAX_GRAPH_WIDTH = 16  # wider steps run eagerly

    def __init__(self, model, aux_layer_ids: list[int] | None = None, cuda_graphs: bool = False,
                 tune_kernels: bool = False, whole_cache: bool = False):
        self.model = model
        self.whole_cache = whole_cache  # every step attends to every slot (docs/BENCHMARKS.md: the span's gain)
        self.device = next(model.parameters()).device
        self.aux_layer_ids = list(aux_layer_ids or [])
        self._capturing = False
        self._captured: dict[int, torch.Tensor] = {}
        decoder = find_decoder(model)
        for layer_id in self.aux_layer_ids:
            decoder.layers[layer_id].register_forward_pre_hook(self._hook(layer_id), with_kwargs=True)
        self._keeps_logits = keeps_logits(model)
        self.static = full_attention_sdpa(model)
        if cuda_graphs and not (self.static and self.device.type == "cuda"):
            raise ValueError("CUDA graphs need a CUDA device and a full-attention SDPA target "
                             f"(here {self.device.type}, static cache {self.static})")
        self.graphs = StepGraphs(cuda_graphs, tune=tune_kernels)
        self.cache: StaticKV | DynamicCache | None = None
        self.length = 0  # positions in the cache
        self._length = torch.zeros(1, dtype=torch.long, device=self.device)  # the same, for captured steps

    def _hook(self, layer_id: int):
        def hook(_module, args, kwargs):
            if self._capturing:
                self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    def start(self, prompt_ids: list[int], capacity: int, with_aux: bool = False, keep: int = 1):
        """A new sequence: run the prompt; the cache holds `capacity` positions in all.
        Returns the last `keep` positions' logits and, with `with_aux`, the prompt's auxiliary states."""
        if not self.static:
            self.cache = DynamicCache()
        else:
            self.reserve(capacity)
        self.length = 0
        return self.forward(torch.tensor([prompt_ids], device=self.device), keep=keep, with_aux=with_aux)

    def reserve(self, capacity: int) -> None:
        """A static cache of at least `capacity` positions (a larger one drops the captured steps: they address
        the old buffers)."""
        if self.static:
            self.cache = reserved(self.cache, capacity, self.graphs)

    @torch.inference_mode()  # as the decoding loops: a graph's static inputs are inference tensors
    def capture_steps(self, longest_prompt: int, k: int) -> None:
        """Capture now every step the decoding loops take with up to k drafts (each prompt bucket up to the longest
        prompt's, 1..k+1 tokens after it; with and without the auxiliary states), so that no capture falls inside
        a timed decode. Reserve the cache the decodes need first: growing it later drops these graphs."""
        if not self.graphs.enabled:
            return
        buckets = prompt_buckets(longest_prompt)
        self.reserve(buckets[-1] + k + 1)
        for bucket in buckets:
            for with_aux in {False, bool(self.aux_layer_ids)}:
                self.start([0] * bucket, capacity=bucket + k + 1, with_aux=with_aux)
        spans = {self._span(n) for n in range(SPAN_GRANULE, self.cache.max_length + SPAN_GRANULE, SPAN_GRANULE)}
        for span in sorted(spans):  # every span a step can read (with whole_cache: the whole cache only)
            for q in range(1, k + 2):
                for with_aux in {False, bool(self.aux_layer_ids)}:
                    self.rewind(span - q)  # the last q slots of the span
                    self.forward(torch.zeros((1, q), dtype=torch.long, device=self.device), keep=q, with_aux=with_aux)

    def rewind(self, length: int) -> None:
        """Forget every position from `length` on."""
        if not self.static:
            self.cache.crop(length)
        self.length = length

    def forward(self, input_ids: torch.Tensor, keep: int, with_aux: bool = False):
        """Run `input_ids` [1, q] after the cached positions.

        Returns the logits of the last `keep` positions and, with `with_aux`, the auxiliary states [1, q, 3H].
        A captured step's outputs are overwritten by its next replay: use them before the next forward."""
        if with_aux and not self.aux_layer_ids:
            raise ValueError("this TargetModel was built without auxiliary layer ids")
        q = input_ids.shape[1]
        if not self.static:
            out = self._step_dynamic(input_ids, keep, with_aux)
        else:
            if self.length + q > self.cache.max_length:
                raise ValueError(f"the KV cache holds {self.cache.max_length} positions; {self.length} + {q} asked for")
            self._length.fill_(self.length)
            bucket = prompt_bucket(q)
            if not self.length and self.graphs.enabled and bucket <= self.cache.max_length:  # a prompt, padded
                step = functools.partial(self._step_static, keep=bucket, with_aux=with_aux, span=self._span(bucket))
                padded = torch.nn.functional.pad(input_ids, (0, bucket - q))
                logits, aux = self.graphs.run(("prompt", bucket, with_aux), step, padded, tune=False)
                out = logits[q - keep : q], (aux[:, :q] if with_aux else None)
            else:
                span = self._span(self.length + q)
                step = functools.partial(self._step_static, keep=keep, with_aux=with_aux, span=span)
                captured = self.length and q <= self.MAX_GRAPH_WIDTH
                out = (self.graphs.run((q, keep, with_aux, span), step, input_ids, family=(q, keep, with_aux))
                       if captured else step(input_ids))
        self.length += q
        return out

    def call(self, keep: int, with_aux: bool, **model_kwargs):
        """The model's forward (`model_kwargs`: inputs, mask, cache) keeping the last `keep` positions' logits
        ([B, keep, V]) and, with `with_aux`, the auxiliary layers' inputs ([B, q, 3H]; else None). The batched
        loops (draftsmith.benchmark.batch_spec) call it too, for the same hooks."""
        self._captured.clear()
        self._capturing = with_aux
        extra = {"logits_to_keep": keep} if self._keeps_logits else {}
        try:
            out = self.model(**model_kwargs, use_cache=True, **extra)
        finally:
            self._capturing = False
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1) if with_aux else None
        return out.logits[:, -keep:], aux

    def _span(self, needed: int) -> int:
        """The cache slots a step whose sequence fills the first `needed` attends to."""
        return self.cache.max_length if self.whole_cache else attention_span(needed, self.cache.max_length)

    def _step_static(self, input_ids: torch.Tensor, keep: int, with_aux: bool, span: int):
        self.cache.span = span  # the attention layers read the cache's first `span` slots (a capture keeps it)
        positions, mask = positions_and_mask(self._length, input_ids.shape[1], span)
        logits, aux = self.call(keep, with_aux, input_ids=input_ids, attention_mask=mask, position_ids=positions[None],
                                cache_position=positions, past_key_values=self.cache)
        return logits[0], aux

    def _step_dynamic(self, input_ids: torch.Tensor, keep: int, with_aux: bool):
        logits, aux = self.call(keep, with_aux, input_ids=input_ids, past_key_values=self.cache)
        return logits[0], aux


@torch.inference_mode()
def greedy_decode(target: TargetModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Trace:
    """Target-only greedy decoding, one target forward per token."""
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    logits, _ = target.start(prompt_ids, capacity=len(prompt_ids) + max_new_tokens)
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
    """Greedy speculative decoding with `proposer` (PromptLookupProposer or Eagle3Proposer)."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    capacity = len(prompt_ids) + max_new_tokens + k + 1  # the last round may verify k tokens past the limit
    logits, aux = target.start(prompt_ids, capacity, with_aux=proposer.needs_aux)
    prompt = torch.tensor(prompt_ids, device=device)
    last = logits[-1].argmax().view(1)
    tokens = [int(last)]
    trace = Trace(tokens=tokens, target_forwards=1, first_token_seconds=time.perf_counter() - start)
    context = list(prompt_ids) + tokens  # host copy for n-gram lookup
    proposer.start(torch.cat([prompt[1:], last]), aux, capacity)
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
    logits, _ = target.start(context, capacity=len(context))
    row = logits[-1].float()
    return {"position": i, "greedy_token": reference[i], "emitted_token": tokens[i],
            "logit_gap": float(row[reference[i]] - row[tokens[i]])}
