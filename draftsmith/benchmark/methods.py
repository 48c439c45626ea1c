"""The offline benchmark's methods as decoders: per method its proposer (prompt lookup, or an EAGLE-3 draft) and a
function that decodes a prompt (batch 1: draftsmith.benchmark.spec_decode) or a batch of prompts
(draftsmith.benchmark.batch_spec) with it; the baseline, target-only greedy, has no proposer."""

from __future__ import annotations

from draftsmith.benchmark.batch_spec import (
    BatchEagle3Proposer,
    BatchPromptLookupProposer,
    batch_greedy_decode,
    batch_speculative_decode,
)
from draftsmith.benchmark.proposers import Eagle3Proposer, PromptLookupProposer
from draftsmith.benchmark.results import BASELINE
from draftsmith.benchmark.spec_decode import greedy_decode, speculative_decode


def method_proposers(drafts: dict, ngram: int, device, batched: bool = False, cuda_graphs: bool = False,
                     tune_kernels: bool = False) -> dict:
    """Per proposing method, its proposer: `prompt_lookup` (n-grams of up to `ngram` tokens), and an EAGLE-3 proposer
    for each draft of `drafts` (method -> draft model). `batched`: the proposers of batched decoding."""
    lookup, eagle3 = (BatchPromptLookupProposer, BatchEagle3Proposer) if batched else (PromptLookupProposer,
                                                                                      Eagle3Proposer)
    return {"prompt_lookup": lookup(ngram, device),
            **{method: eagle3(draft, cuda_graphs=cuda_graphs, tune_kernels=tune_kernels)
               for method, draft in drafts.items()}}


def method_decoders(methods: list[str], target, proposers: dict, k: int, max_new_tokens: int, stop_ids: set[int],
                    batched: bool = False) -> dict:
    """Per method, a function of one prompt's token ids (`batched`: of a list of them) that decodes it on `target` (a
    TargetModel; `batched`: a BatchTarget) and returns its trace (`batched`: one per row): target-only greedy for the
    baseline, speculative decoding with k drafted tokens a round and the method's proposer for the others."""
    greedy, speculative = ((batch_greedy_decode, batch_speculative_decode) if batched
                           else (greedy_decode, speculative_decode))

    def decoder(method: str):
        if method == BASELINE:
            return lambda ids: greedy(target, ids, max_new_tokens, stop_ids)
        return lambda ids: speculative(target, proposers[method], ids, k, max_new_tokens, stop_ids)

    return {m: decoder(m) for m in methods}
