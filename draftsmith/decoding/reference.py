"""The eager reference decoder: batch-1 greedy and speculative loops over transformers' DynamicCache, and their
proposers (prompt lookup, EAGLE-3 chain drafts, the hybrid of the two).

The engine (draftsmith.decoding.engine.serve) decodes at batch 1 and under load alike over static caches and CUDA
graphs. These loops are its reference: the tests hold its tokens and its accepted drafts equal to theirs, and the
offline benchmark runs them for a target whose masks draftsmith cannot build (sliding windows, non-SDPA attention).

Speculative round (temperature 0): the proposer drafts up to k tokens; the target runs once over [last token, drafts]
with its KV cache; drafts are accepted while they equal the target's argmax, and the target's own token at the first
mismatch (or after the last draft) is appended as the bonus token. Every emitted token is the target's argmax, so the
output equals target-only greedy decoding up to floating-point ties.

A proposer has `needs_aux` (whether it reads the target's auxiliary hidden states), `start(next_tokens, aux)` (the
prompt), `propose(context, k)` (up to k drafted tokens, on the device) and `accept(next_tokens, aux)` (what the target
verified). EAGLE-3 conventions (speculators 0.3.0, `Eagle3DraftModel.forward` after `shift_batch`): draft position t
reads `cat(embed(x[t+1]), fc(cat(aux states at t)))` at position id t+1 and predicts x[t+2]; each further chain step
feeds the embedding of the token just drafted with the draft's own last-layer output (before `norm`) at the next
position id, attending to the verified context and to its own chain. Draft token d maps to target token d + d2t[d].
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from draftsmith.decoding import draft_kernels
from draftsmith.decoding.ngrams import ContextNgrams
from draftsmith.decoding.target import TargetModel, causal_mask
from draftsmith.decoding.trace import Trace, answer_done, cut_output, synchronize


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
    """Greedy speculative decoding with `proposer` (one of the proposers below)."""
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


def draft_layers_forward(draft, token_ids: torch.Tensor, hidden: torch.Tensor,
                         cache: DynamicCache | None = None) -> torch.Tensor:
    """Run the draft's decoder layers on `cat(embed(token_ids), hidden)` ([1, n] and [1, n, H]) after the `cache`'s
    positions (none without one), at position ids one more than their slots (EAGLE-3's shift), causal: each attends
    to the cache and to those before it. Returns the last layer's output before `norm` ([1, n, H])."""
    n, past = token_ids.shape[1], cache.get_seq_length() if cache is not None else 0
    slots = torch.arange(past, past + n, device=hidden.device)
    mask = causal_mask(past, n, hidden.device) if past + n > 1 else None
    return draft_kernels.draft_layers(draft, token_ids, hidden, (slots + 1).unsqueeze(0), slots, mask, cache)


class Eagle3Proposer:
    """Chain drafts from a speculators Eagle3DraftModel fed with the target's auxiliary hidden states, eagerly over a
    DynamicCache that holds one entry per verified position (step 0, target states): a round writes the newly
    verified positions, drafts a chain of k after them and crops the chain's entries off again. `fewer_kernels`: the
    draft's norms fused and its rotary embedding a table, as the engine runs it (draftsmith.decoding.draft_kernels;
    off: its modules as built)."""

    needs_aux = True

    def __init__(self, draft, fewer_kernels: bool = True):
        draft_kernels.use_sdpa(draft)
        if fewer_kernels:
            draft_kernels.fewer_kernels(draft)  # the module: the parameter takes its name
        self.draft = draft

    def start(self, next_tokens: torch.Tensor, aux: torch.Tensor) -> None:
        """next_tokens[t] = x[t+1] for the prompt positions t, the first generated token last."""
        self.cache = DynamicCache()
        self.pending_tokens, self.pending_aux = next_tokens.view(1, -1), aux

    def propose(self, context: list[int], k: int, chain: int | None = None) -> torch.Tensor:
        """Up to k drafts: the newly verified inputs into the cache, then a chain of `chain` (default k) drafts; a
        chain of 0 only feeds the cache (a round whose drafts come from elsewhere: the hybrid's)."""
        draft, chain = self.draft, k if chain is None else chain
        hidden = draft_layers_forward(draft, self.pending_tokens, draft.fc(self.pending_aux), self.cache)[:, -1:]
        verified, drafted = self.cache.get_seq_length(), []
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
