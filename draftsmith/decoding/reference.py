"""The eager reference decoder: batch-1 greedy and speculative loops over transformers' DynamicCache, and the EAGLE-3
proposer over such a cache (`Eagle3Proposer`; prompt lookup and the hybrid are the engine's own proposers,
draftsmith.decoding.engine_proposers, with one row).

The engine (draftsmith.decoding.engine.serve) decodes at batch 1 and under load alike over static caches and CUDA
graphs. These loops are its reference: the tests hold its tokens and its accepted drafts equal to theirs, and the
offline benchmark runs them for a target whose masks draftsmith cannot build (sliding windows, non-SDPA attention).

Speculative round (temperature 0): the proposer drafts up to k tokens; the target runs once over [last token, drafts]
with its KV cache; drafts are accepted while they equal the target's argmax, and the target's own token at the first
mismatch (or after the last draft) is appended as the bonus token. Every emitted token is the target's argmax, so the
output equals target-only greedy decoding up to floating-point ties.

A proposer speaks the engine's interface (draftsmith.decoding.engine_proposers) with one row. EAGLE-3 conventions
(speculators 0.3.0, `Eagle3DraftModel.forward` after `shift_batch`): draft position t reads `cat(embed(x[t+1]),
fc(cat(aux states at t)))` at position id t+1 and predicts x[t+2]; each further chain step feeds the embedding of the
token just drafted with the draft's own last-layer output (before `norm`) at the next position id, attending to the
verified context and to its own chain. Draft token d maps to target token d + d2t[d].
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from draftsmith.decoding import draft_kernels
from draftsmith.decoding.batch_target import AdmittedPrompts
from draftsmith.decoding.engine_proposers import NoDrafts
from draftsmith.decoding.target import TargetModel, causal_mask
from draftsmith.decoding.trace import Trace, answer_done, cut_output, synchronize


def greedy_decode(target: TargetModel, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> Trace:
    """Target-only greedy decoding, one target forward per token: the speculative loop without drafts."""
    return speculative_decode(target, NoDrafts(), prompt_ids, 1, max_new_tokens, stop_ids)


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
    last = logits[-1].argmax().view(1)
    tokens = [int(last)]
    trace = Trace(tokens=tokens, target_forwards=1, first_token_seconds=time.perf_counter() - start)
    context = list(prompt_ids) + tokens  # host copy for n-gram lookup
    proposer.begin(1, len(prompt_ids) + max_new_tokens + k + 1)
    ids = torch.tensor([prompt_ids], device=device)
    proposer.prefill([0], AdmittedPrompts(ids, torch.zeros(1, dtype=torch.long, device=device), len(prompt_ids) - 1,
                                          aux), last)
    done = answer_done(tokens, tokens, max_new_tokens, stop_ids)
    while not done:
        draft, proposed = proposer.propose([context], k)
        m = int(draft.shape[1])
        inputs = torch.cat([last[None], draft], dim=1) if m else last[None]
        logits, aux = target.forward(inputs, keep=m + 1, with_aux=proposer.needs_aux)
        trace.target_forwards += 1
        verified = logits.argmax(-1)  # [m + 1]: the target's token after each input position
        both = (torch.cat([draft[0], verified]) if m else verified).tolist()  # the one host sync of the round
        drafted, target_tokens = both[:m], both[m:]
        accepted = 0
        while accepted < proposed[0] and drafted[accepted] == target_tokens[accepted]:
            accepted += 1
        new = target_tokens[: accepted + 1]
        trace.proposed.append(proposed[0])
        trace.accepted.append(accepted)
        tokens += new
        context += new
        target.rewind(len(prompt_ids) + len(tokens) - 1)  # keep everything but the bonus token
        last = verified[accepted : accepted + 1]
        proposer.accept(verified[None], aux, [accepted + 1])
        done = answer_done(tokens, new, max_new_tokens, stop_ids)
    synchronize(device)
    trace.seconds = time.perf_counter() - start
    trace.tokens = cut_output(tokens, max_new_tokens, stop_ids)
    return trace


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

    def begin(self, rows: int, length: int) -> None:
        if rows != 1:
            raise ValueError(f"the reference decodes one request at a time, not {rows}")

    def prefill(self, rows: list[int], prompts: AdmittedPrompts, first: torch.Tensor) -> None:
        """The prompt (`prompts`: the target's, one row, unpadded) and its first generated token: the draft's inputs
        at every prompt position (the token after it, the target's states at it), pending for the first round."""
        tokens = prompts.ids.roll(-1, dims=1)
        tokens[:, prompts.last] = first
        self.cache = DynamicCache()
        self.pending_tokens, self.pending_aux = tokens[:, : prompts.last + 1], prompts.aux[:, : prompts.last + 1]

    def propose(self, contexts: list[list[int]], k: int, chain: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """A chain of `chain` (default k) drafts [1, chain] and its count: the newly verified inputs into the cache,
        then the chain; a chain of 0 only feeds the cache (a round whose drafts come from elsewhere: the hybrid's)."""
        draft, chain = self.draft, k if chain is None else chain
        hidden = draft_layers_forward(draft, self.pending_tokens, draft.fc(self.pending_aux), self.cache)[:, -1:]
        verified, drafted = self.cache.get_seq_length(), [self.pending_tokens[:, :0]]
        for step in range(chain):
            token = draft.lm_head(draft.norm(hidden)).argmax(-1)  # [1, 1], draft vocabulary
            token = token + draft.d2t[token]
            drafted.append(token)
            if step + 1 < chain:
                hidden = draft_layers_forward(draft, token, hidden, self.cache)
        self.cache.crop(verified)
        return torch.cat(drafted, dim=-1), [chain]

    def accept(self, next_tokens: torch.Tensor, aux: torch.Tensor, counts: list[int]) -> None:
        """next_tokens [1, n]: its first counts[0] the accepted drafts and the bonus token; aux [1, n, 3H]: the
        target's states at the positions before them."""
        self.pending_tokens, self.pending_aux = next_tokens[:, : counts[0]], aux[:, : counts[0]]
