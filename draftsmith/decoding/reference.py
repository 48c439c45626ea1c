"""The eager reference decoder: batch-1 greedy and speculative loops over transformers' DynamicCache, drafting with
the engine's own proposers (draftsmith.decoding.engine_proposers) at one row, run eagerly.

The engine (draftsmith.decoding.engine.serve) decodes at batch 1 and under load alike over static caches and CUDA
graphs. These loops are its reference: the tests hold its tokens and its accepted drafts equal to theirs, and the
offline benchmark runs them for a target whose masks draftsmith cannot build (sliding windows, non-SDPA attention).

Speculative round (temperature 0): the proposer drafts up to k tokens; the target runs once over [last token, drafts]
with its KV cache; drafts are accepted while they equal the target's argmax, and the target's own token at the first
mismatch (or after the last draft) is appended as the bonus token. Every emitted token is the target's argmax, so the
output equals target-only greedy decoding up to floating-point ties.

What the reference holds apart from the engine is the target's side: its cache, masks, slots and verification. The
EAGLE-3 proposer's chain is checked against speculators' own training forward instead
(tests/test_decoding.py, test_draft_chain_matches_speculators_training_forward).
"""

from __future__ import annotations

import time

import torch

from draftsmith.decoding.batch_target import AdmittedPrompts
from draftsmith.decoding.engine_proposers import NoDrafts
from draftsmith.decoding.target import TargetModel
from draftsmith.decoding.trace import Trace, cut_output, synchronize


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
    tokens = new = [int(last)]
    trace = Trace(tokens=tokens, target_forwards=1, first_token_seconds=time.perf_counter() - start)
    context = list(prompt_ids) + tokens  # host copy for n-gram lookup
    proposer.begin(1, len(prompt_ids) + max_new_tokens + k + 1)
    ids = torch.tensor([prompt_ids], device=device)
    proposer.prefill([0], AdmittedPrompts(ids, torch.zeros(1, dtype=torch.long, device=device), len(prompt_ids) - 1,
                                          aux), last)
    while len(tokens) < max_new_tokens and not any(t in stop_ids for t in new):  # the stopping rule (cut_output)
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
    synchronize(device)
    trace.seconds = time.perf_counter() - start
    trace.tokens = cut_output(tokens, max_new_tokens, stop_ids)
    return trace
