"""Greedy decoding loops of the offline benchmark: target-only, prompt lookup, EAGLE-3 chain drafts.

All methods share one verification loop and one stopping rule, so their outputs are
comparable token for token: generation stops after `max_new_tokens` tokens or at the first
stop token (kept in the output), whichever comes first.

Speculative round (batch size 1, temperature 0): the proposer drafts up to k tokens; the
target runs once over [last token, drafts] with its KV cache; drafts are accepted while they
equal the target's argmax, and the target's own token at the first mismatch (or after the
last draft) is appended as the bonus token. Every emitted token is the target's argmax, so
the output equals target-only greedy decoding up to floating-point ties.

EAGLE-3 conventions (speculators 0.3.0, `Eagle3DraftModel.forward` after `shift_batch`):
draft position t reads `cat(embed(x[t+1]), fc(cat(aux states at t)))` at position id t+1 and
predicts x[t+2]; each further chain step feeds the embedding of the token just drafted with
the draft's own last-layer output (before `norm`) at the next position id, attending to the
verified context and to its own chain. Draft token d maps to target token d + d2t[d].
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from draftsmith.target_model.layers import find_decoder, text_config


@dataclass
class Trace:
    """What one decoding run did. `proposed[r]`/`accepted[r]`: draft tokens of verification round r."""

    tokens: list[int]
    target_forwards: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0

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
        }
        for i in range(1, k + 1):
            row[f"accept_pos_{i}"] = sum(1 for a in self.accepted if a >= i)
        return row


def cut_output(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The shared stopping rule: at most max_new_tokens, ending at the first stop token (kept)."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def _done(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    return len(tokens) >= max_new_tokens or any(t in stop_ids for t in new)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def causal_mask(past: int, q: int, device) -> torch.Tensor:
    """Boolean SDPA mask [1, 1, q, past + q] for q new positions after `past` cached ones (True = attend)."""
    keys = torch.arange(past + q, device=device)
    return (keys[None, :] <= keys[past:, None]).view(1, 1, q, past + q)


class TargetModel:
    """A Hugging Face causal LM run with a KV cache, capturing the inputs of the auxiliary decoder layers."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        self.aux_layer_ids = list(aux_layer_ids or [])
        self._capturing = False
        self._captured: dict[int, torch.Tensor] = {}
        decoder = find_decoder(model)
        for layer_id in self.aux_layer_ids:
            decoder.layers[layer_id].register_forward_pre_hook(self._hook(layer_id), with_kwargs=True)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Building the causal mask of a multi-token verification step ourselves is measurably cheaper
        # than transformers' mask functions (which pass a 4D mask through); only for full-attention SDPA.
        config = text_config(model.config)
        self._own_mask = (getattr(model.config, "_attn_implementation", None) == "sdpa"
                          and not getattr(config, "sliding_window", None)
                          and "sliding_attention" not in (getattr(config, "layer_types", None) or []))

    def _hook(self, layer_id: int):
        def hook(_module, args, kwargs):
            if self._capturing:
                self._captured[layer_id] = args[0] if args else kwargs["hidden_states"]

        return hook

    def forward(self, input_ids: torch.Tensor, cache: DynamicCache, keep: int, with_aux: bool = False):
        """Run `input_ids` [1, q] after the cached prefix.

        Returns the logits of the last `keep` positions and, with `with_aux`, the auxiliary states [1, q, 3H]."""
        if with_aux and not self.aux_layer_ids:
            raise ValueError("this TargetModel was built without auxiliary layer ids")
        self._captured.clear()
        self._capturing = with_aux
        extra = {"logits_to_keep": keep} if self._keeps_logits else {}
        past, q = cache.get_seq_length(), input_ids.shape[1]
        if self._own_mask and past and q > 1:
            extra["attention_mask"] = causal_mask(past, q, input_ids.device)
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True, **extra)
        self._capturing = False
        logits = out.logits[0, -keep:]
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1) if with_aux else None
        return logits, aux


@torch.inference_mode()
def greedy_decode(target: TargetModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Trace:
    """Target-only greedy decoding, one target forward per token."""
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    cache = DynamicCache()
    logits, _ = target.forward(torch.tensor([prompt_ids], device=device), cache, keep=1)
    tokens: list[int] = []
    while True:
        next_token = logits[-1].argmax()
        tokens.append(int(next_token))  # the host must see each token to apply the stopping rule
        if _done(tokens, tokens[-1:], max_new_tokens, stop_ids):
            break
        logits, _ = target.forward(next_token.view(1, 1), cache, keep=1)
    synchronize(device)
    return Trace(tokens=tokens, target_forwards=len(tokens), seconds=time.perf_counter() - start)


@torch.inference_mode()
def speculative_decode(target: TargetModel, proposer, prompt_ids: list[int], k: int, max_new_tokens: int,
                       stop_ids: set[int]) -> Trace:
    """Greedy speculative decoding with `proposer` (PromptLookupProposer or Eagle3Proposer)."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    device = target.device
    synchronize(device)
    start = time.perf_counter()
    cache = DynamicCache()
    prompt = torch.tensor(prompt_ids, device=device)
    logits, aux = target.forward(prompt.view(1, -1), cache, keep=1, with_aux=proposer.needs_aux)
    last = logits[-1].argmax().view(1)
    tokens = [int(last)]
    trace = Trace(tokens=tokens, target_forwards=1)
    context = list(prompt_ids) + tokens  # host copy for n-gram lookup
    proposer.start(torch.cat([prompt[1:], last]), aux)
    done = _done(tokens, tokens, max_new_tokens, stop_ids)
    while not done:
        draft = proposer.propose(context, k)
        m = int(draft.shape[0])
        logits, aux = target.forward(torch.cat([last, draft]).view(1, -1), cache, keep=m + 1,
                                     with_aux=proposer.needs_aux)
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
        cache.crop(len(prompt_ids) + len(tokens) - 1)  # keep everything but the bonus token
        last = verified[accepted : accepted + 1]
        proposer.accept(verified[: accepted + 1], aux[:, : accepted + 1] if aux is not None else None)
        done = _done(tokens, new, max_new_tokens, stop_ids)
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
    logits, _ = target.forward(torch.tensor([list(prompt_ids) + reference[:i]], device=target.device), DynamicCache(),
                               keep=1)
    row = logits[-1].float()
    return {"position": i, "greedy_token": reference[i], "emitted_token": tokens[i],
            "logit_gap": float(row[reference[i]] - row[tokens[i]])}


def prompt_lookup_candidates(context: list[int], k: int, max_ngram: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the context's last n tokens,
    trying the longest n (<= max_ngram) first; [] when no n-gram recurs."""
    tokens = np.asarray(context)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0..length-1-n
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return list(context[start : start + k])
    return []


class PromptLookupProposer:
    """Prompt-lookup (n-gram) decoding: drafts copied from the prompt and the text generated so far."""

    needs_aux = False

    def __init__(self, max_ngram: int, device: torch.device):
        if max_ngram < 1:
            raise ValueError(f"prompt_lookup_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.device = device

    def start(self, next_tokens, aux) -> None:
        pass

    def propose(self, context: list[int], k: int) -> torch.Tensor:
        return torch.tensor(prompt_lookup_candidates(context, k, self.max_ngram), dtype=torch.long, device=self.device)

    def accept(self, next_tokens, aux) -> None:
        pass


def use_sdpa(draft) -> None:
    """Decode with SDPA and a KV cache; the checkpoint's layer config asks for speculators' FlexAttention (training)."""
    draft.config.transformer_layer_config._attn_implementation = "sdpa"
    for layer in draft.layers:
        layer.self_attn.config._attn_implementation = "sdpa"


def draft_layers_forward(draft, token_ids: torch.Tensor, hidden: torch.Tensor, first_position: int,
                         cache: DynamicCache | None) -> torch.Tensor:
    """Run the draft's decoder layers on `cat(embed(token_ids), hidden)` ([1, n] and [1, n, H]) at
    position ids first_position.. after the cached entries; causal within the n new entries.
    Returns the last layer's output before `norm` ([1, n, H])."""
    n = token_ids.shape[1]
    past = cache.get_seq_length() if cache is not None else 0
    device = hidden.device
    position_ids = torch.arange(first_position, first_position + n, device=device).unsqueeze(0)
    cache_position = torch.arange(past, past + n, device=device)
    # SDPA's is_causal would align the causal mask top-left, wrong after a cached prefix
    mask = causal_mask(past, n, device) if n > 1 else None
    states = torch.cat([draft.embed_tokens(token_ids), hidden], dim=-1)
    position_embeddings = draft.rotary_emb(states, position_ids)
    for layer in draft.layers:
        states = layer(states, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                       use_cache=cache is not None, cache_position=cache_position,
                       position_embeddings=position_embeddings)
    return states


class Eagle3Proposer:
    """Chain drafts from a speculators Eagle3DraftModel fed with the target's auxiliary hidden states.

    The draft's KV cache holds one entry per verified position (step 0, target states); the
    chain entries of a round are cropped away before the next round adds the new verified ones.
    """

    needs_aux = True

    def __init__(self, draft):
        use_sdpa(draft)
        self.draft = draft

    def start(self, next_tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """next_tokens[t] = x[t+1] for the prompt positions t, the first generated token last."""
        self.cache = DynamicCache()
        self.verified = 0  # step-0 entries in the cache = position id of the last one
        self.pending_tokens, self.pending_aux = next_tokens.view(1, -1), aux

    def propose(self, context: list[int], k: int) -> torch.Tensor:
        draft = self.draft
        self.cache.crop(self.verified)
        n = self.pending_tokens.shape[1]
        states = draft_layers_forward(draft, self.pending_tokens, draft.fc(self.pending_aux), self.verified + 1,
                                      self.cache)
        self.verified += n
        hidden = states[:, -1:]
        drafted = []
        for step in range(k):
            token = draft.lm_head(draft.norm(hidden)).argmax(-1)  # [1, 1], draft vocabulary
            token = token + draft.d2t[token]
            drafted.append(token)
            if step + 1 < k:
                hidden = draft_layers_forward(draft, token, hidden, self.verified + 1 + step, self.cache)
        return torch.cat(drafted, dim=-1).view(-1)

    def accept(self, next_tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """next_tokens: the accepted drafts and the bonus token; aux: target states at the positions before them."""
        self.pending_tokens, self.pending_aux = next_tokens.view(1, -1), aux
