"""The offline benchmark's methods: per drafting method, how its proposer is built (`PROPOSERS`: a new method is its
proposer class and one entry here, plus its name in draftsmith.benchmark.results.METHODS, the tables' order), and
per method a function that decodes prompts with it: the engine's (draftsmith.decoding.engine.serve, N requests
in flight; `one_at_a_time` for batch 1) or the eager reference's (draftsmith.decoding.reference, one prompt). The
baseline, target-only greedy, has no proposer."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.benchmark.results import BASELINE
from draftsmith.decoding.engine import serve
from draftsmith.decoding.engine_proposers import BatchEagle3Proposer, HybridProposer, NoDrafts, PromptLookupProposer
from draftsmith.decoding.reference import greedy_decode, speculative_decode


@dataclass(frozen=True)
class ProposerSettings:
    """What the proposers are built from: the EAGLE-3 draft models by method (eagle3_draft: the trained one), the
    benchmark's settings, and whether they are the engine's (`batched`: rows in flight, with CUDA graphs) or the eager
    reference's."""

    device: object
    ngram: int
    drafts: dict = field(default_factory=dict)
    hybrid_min_ngram: int | None = None
    batched: bool = False
    cuda_graphs: bool = False
    ragged: bool = False  # the engine's attention over each row's own slots (the target's and the draft's alike)


def _lookup(s: ProposerSettings, built: dict):
    return PromptLookupProposer(s.ngram, s.device)


def _eagle3(method: str):
    def build(s: ProposerSettings, built: dict):
        if method not in s.drafts:
            raise ValueError(f"benchmark method {method} needs its draft model, which was not loaded")
        # the reference loop's prompts come unpadded, each length a new shape: graphs for the engine's alone
        return BatchEagle3Proposer(s.drafts[method], cuda_graphs=s.cuda_graphs and s.batched, ragged=s.ragged and s.batched)

    return build


def _hybrid(s: ProposerSettings, built: dict):
    if s.hybrid_min_ngram is None:
        raise ValueError("benchmark method hybrid needs benchmark.hybrid_min_ngram")
    return HybridProposer(built["prompt_lookup"], built["eagle3_draft"], s.hybrid_min_ngram)


# drafting method -> (builder of its proposer from the settings and the proposers built so far, the methods whose
# proposers it uses: built first and shared, so the hybrid's EAGLE-3 rounds are the trained draft's own captured ones)
PROPOSERS = {
    "prompt_lookup": (_lookup, ()),
    "untrained_draft": (_eagle3("untrained_draft"), ()),
    "eagle3_draft": (_eagle3("eagle3_draft"), ()),
    "hybrid": (_hybrid, ("prompt_lookup", "eagle3_draft")),
}


def method_proposers(methods: list[str], settings: ProposerSettings) -> dict:
    """The proposer of each drafting method in `methods`, and of the methods they build on."""
    built: dict = {}

    def build(method: str) -> None:
        if method in built:
            return
        if method not in PROPOSERS:
            raise ValueError(f"unknown benchmark method {method!r}; known: {[BASELINE, *PROPOSERS]}")
        builder, needs = PROPOSERS[method]
        for need in needs:
            build(need)
        built[method] = builder(settings, built)

    for method in methods:
        if method != BASELINE:
            build(method)
    return built


def method_decoders(methods: list[str], target, proposers: dict, k: int, max_new_tokens: int, stop_ids: set[int],
                    concurrency: int | None = None, refill_rounds: float = 0.0) -> dict:
    """Per method, a function of a list of prompts' token ids (without `concurrency`: of one prompt's) that decodes
    them on `target` (a BatchTarget, that many requests in flight, refilled by `refill_rounds`: serve; without: a
    TargetModel, the eager reference) and returns one trace per prompt (without: its trace): target-only greedy for
    the baseline, speculative decoding with k drafted tokens a round and the method's proposer for the others."""
    if concurrency is not None:
        def served(proposer):
            return lambda prompts: serve(target, proposer, prompts, concurrency, k, max_new_tokens, stop_ids,
                                         refill_rounds=refill_rounds)

        return {m: served(NoDrafts() if m == BASELINE else proposers[m]) for m in methods}

    def decoder(method: str):
        if method == BASELINE:
            return lambda ids: greedy_decode(target, ids, max_new_tokens, stop_ids)
        return lambda ids: speculative_decode(target, proposers[method], ids, k, max_new_tokens, stop_ids)

    return {m: decoder(m) for m in methods}


def one_at_a_time(decoders: dict) -> dict:
    """The engine's decoders (of lists of prompts) as decoders of one prompt: batch 1."""
    return {method: (lambda ids, decode=decode: decode([ids])[0]) for method, decode in decoders.items()}
