"""The proposers of the reference loop (draftsmith.benchmark.spec_decode, batch 1, eager): prompt lookup (n-gram drafts
copied from the context), EAGLE-3 chain drafts, and the hybrid of the two; the engine's (draftsmith.benchmark.
batch_proposers) are these for rows in flight. A proposer has `needs_aux` (whether it reads the target's auxiliary
hidden states), `start(next_tokens, aux)` (the prompt), `propose(context, k)` (up to k drafted tokens, on the device)
and `accept(next_tokens, aux)` (what the target verified).

EAGLE-3 conventions (speculators 0.3.0, `Eagle3DraftModel.forward` after `shift_batch`):
draft position t reads `cat(embed(x[t+1]), fc(cat(aux states at t)))` at position id t+1 and
predicts x[t+2]; each further chain step feeds the embedding of the token just drafted with
the draft's own last-layer output (before `norm`) at the next position id, attending to the
verified context and to its own chain. Draft token d maps to target token d + d2t[d].
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from draftsmith.benchmark.spec_decode import causal_mask
from draftsmith.decoding import draft_kernels


def prompt_lookup_candidates(context: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the context's last n tokens,
    trying the longest n (<= max_ngram) first, down to min_ngram; [] when no such n-gram recurs. A scan of the whole
    context: the definition that the proposers' incremental NgramIndex is tested against."""
    tokens = np.asarray(context)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0..length-1-n
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return list(context[start : start + k])
    return []


class NgramIndex:
    """The earliest start of every n-gram (n <= max_ngram) of a growing token sequence: `candidates` answers what
    prompt_lookup_candidates answers on the same tokens, in time of the tokens added since the last call rather than
    a scan of the whole context (at 64 rows a scan a row took milliseconds of host time a round)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.first: list[dict] = [{} for _ in range(max_ngram + 1)]  # n -> {n-gram: its earliest start}

    def extend(self, tokens: list[int]) -> None:
        old = len(self.tokens)
        self.tokens += tokens
        for n in range(1, self.max_ngram + 1):  # the windows that end before the last token, as the scan's
            first, seq = self.first[n], self.tokens
            for start in range(max(0, old - n), len(seq) - n):
                first.setdefault(tuple(seq[start: start + n]), start)

    def candidates(self, k: int, min_ngram: int = 1) -> list[int]:
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), min_ngram - 1, -1):
            start = self.first[n].get(tuple(seq[len(seq) - n:]))
            if start is not None:
                return seq[start + n: start + n + k]
        return []


class ContextNgrams:
    """Each slot's NgramIndex (a slot: a batch row, or 0), kept for the context list the slot was last asked about:
    the decoding loops extend a context in place and give a new request a new list, which starts a new index."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self._held: dict[int, tuple[list[int], NgramIndex]] = {}

    def candidates(self, slot: int, context: list[int], k: int, min_ngram: int = 1) -> list[int]:
        held = self._held.get(slot)
        if held is None or held[0] is not context or len(context) < len(held[1].tokens):
            held = self._held[slot] = (context, NgramIndex(self.max_ngram))
        index = held[1]
        index.extend(context[len(index.tokens):])
        return index.candidates(k, min_ngram)


class PromptLookupProposer:
    """Prompt-lookup (n-gram) decoding: drafts copied from the prompt and the text generated so far."""

    needs_aux = False

    def __init__(self, max_ngram: int, device: torch.device):
        if max_ngram < 1:
            raise ValueError(f"prompt_lookup_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.device = device
        self.ngrams = ContextNgrams(max_ngram)

    def start(self, next_tokens, aux) -> None:
        pass

    def propose(self, context: list[int], k: int) -> torch.Tensor:
        return torch.tensor(self.ngrams.candidates(0, context, k), dtype=torch.long, device=self.device)

    def accept(self, next_tokens, aux) -> None:
        pass


def use_sdpa(draft) -> None:
    """Decode with SDPA and a KV cache; the checkpoint's layer config asks for speculators' FlexAttention (training)."""
    draft.config.transformer_layer_config._attn_implementation = "sdpa"
    for layer in draft.layers:
        layer.self_attn.config._attn_implementation = "sdpa"


def draft_layers_forward(draft, token_ids: torch.Tensor, hidden: torch.Tensor, cache: DynamicCache | None = None,
                         ) -> torch.Tensor:
    """Run the draft's decoder layers on `cat(embed(token_ids), hidden)` ([1, n] and [1, n, H]) after the `cache`'s
    positions (none without one), at position ids one more than their slots (EAGLE-3's shift), causal: each attends
    to the cache and to those before it. Returns the last layer's output before `norm` ([1, n, H])."""
    n, past = token_ids.shape[1], cache.get_seq_length() if cache is not None else 0
    slots = torch.arange(past, past + n, device=hidden.device)
    mask = causal_mask(past, n, hidden.device) if past + n > 1 else None
    return draft_layers(draft, token_ids, hidden, (slots + 1).unsqueeze(0), slots, mask, cache)


def draft_layers(draft, token_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                 cache_position: torch.Tensor, mask: torch.Tensor | None, cache) -> torch.Tensor:
    """The draft's decoder layers on `cat(embed(token_ids), hidden)` ([B, n], [B, n, H]) at `position_ids` ([B, n]),
    the caller's `mask` and cache (`cache_position`: where a static cache writes). Returns the last layer's output
    before `norm` ([B, n, H])."""
    states = torch.cat([draft.embed_tokens(token_ids), hidden], dim=-1)
    position_embeddings = draft.rotary_emb(states, position_ids)
    for layer in draft.layers:
        states = layer(states, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                       use_cache=cache is not None, cache_position=cache_position,
                       position_embeddings=position_embeddings)
    return states


class Eagle3Proposer:
    """Chain drafts from a speculators Eagle3DraftModel fed with the target's auxiliary hidden states, eagerly over a
    DynamicCache that holds one entry per verified position (step 0, target states): a round writes the newly
    verified positions, drafts a chain of k after them and crops the chain's entries off again. `fewer_kernels`: the
    draft's norms fused and its rotary embedding a table, as the engine runs it (draftsmith.decoding.draft_kernels;
    off: its modules as built)."""

    needs_aux = True

    def __init__(self, draft, fewer_kernels: bool = True):
        use_sdpa(draft)
        if fewer_kernels:
            draft_kernels.fewer_kernels(draft)
        self.draft = draft

    def start(self, next_tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """next_tokens[t] = x[t+1] for the prompt positions t, the first generated token last."""
        self.cache = DynamicCache()
        self.pending_tokens, self.pending_aux = next_tokens.view(1, -1), aux

    @property
    def verified(self) -> int:
        return self.cache.get_seq_length()

    def propose(self, context: list[int], k: int, chain: int | None = None) -> torch.Tensor:
        """Up to k drafts: the newly verified inputs into the cache, then a chain of `chain` (default k) drafts; a
        chain of 0 only feeds the cache (a round whose drafts come from elsewhere: the hybrid's)."""
        draft, chain = self.draft, k if chain is None else chain
        hidden = draft_layers_forward(draft, self.pending_tokens, draft.fc(self.pending_aux), self.cache)[:, -1:]
        verified, drafted = self.verified, []
        for step in range(chain):
            token = draft.lm_head(draft.norm(hidden)).argmax(-1)  # [1, 1], draft vocabulary
            token = token + draft.d2t[token]
            drafted.append(token)
            if step + 1 < chain:
                hidden = draft_layers_forward(draft, token, hidden, self.cache)
        self.cache.crop(verified)
        return torch.cat(drafted, dim=-1).view(-1) if drafted else torch.zeros(0, dtype=torch.long,
                                                                              device=hidden.device)

    def accept(self, next_tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """next_tokens: the accepted drafts and the bonus token; aux: target states at the positions before them."""
        self.pending_tokens, self.pending_aux = next_tokens.view(1, -1), aux


class HybridProposer:
    """Prompt lookup's drafts where the context's last `min_ngram` or more tokens recur (n-grams of up to the lookup's
    max_ngram), the EAGLE-3 draft's elsewhere. The EAGLE-3 round runs every round either way: it feeds the draft the
    newly verified positions, so its cache stays current whichever drafts the target verified; a round that takes
    lookup's drafts skips the draft's chain. `rounds` counts the rounds each source drafted."""

    needs_aux = True

    def __init__(self, lookup: PromptLookupProposer, eagle: Eagle3Proposer, min_ngram: int):
        if not 1 <= min_ngram <= lookup.max_ngram:
            raise ValueError(f"hybrid_min_ngram must be within 1..prompt_lookup_ngram ({lookup.max_ngram}), got "
                             f"{min_ngram}")
        self.lookup, self.eagle, self.min_ngram = lookup, eagle, min_ngram
        self.rounds = {"prompt_lookup": 0, "eagle3": 0}

    def start(self, next_tokens, aux) -> None:
        self.eagle.start(next_tokens, aux)

    def propose(self, context: list[int], k: int) -> torch.Tensor:
        found = self.lookup.ngrams.candidates(0, context, k, self.min_ngram)
        self.rounds["prompt_lookup" if found else "eagle3"] += 1
        if not found:
            return self.eagle.propose(context, k)
        self.eagle.propose(context, k, chain=0)
        return torch.tensor(found, dtype=torch.long, device=self.lookup.device)

    def accept(self, next_tokens, aux) -> None:
        self.eagle.accept(next_tokens, aux)
