"""The checks of test_ragged_attention.py, run in a process of their own with TRITON_INTERPRET=1 set before Triton is
imported (Triton decides at import whether its own library functions run in the interpreter, and in the engine tests'
process vLLM has imported it already)."""

from __future__ import annotations

import sys

import torch


def reference(query, key, value, bounds, scale):
    """SDPA of each row over its own slots, the KV heads repeated for their query heads: [B, 1, H, D]."""
    group = query.shape[1] // key.shape[1]
    out = []
    for row, (first, last) in enumerate(bounds.tolist()):
        keys = key[row, :, first: last + 1].repeat_interleave(group, 0)
        values = value[row, :, first: last + 1].repeat_interleave(group, 0)
        out.append(torch.nn.functional.scaled_dot_product_attention(query[row], keys, values, scale=scale))
    return torch.stack(out).transpose(1, 2)


def kernel_against_sdpa(heads: int, kv_heads: int, dim: int, queries: int) -> None:
    from draftsmith.decoding.ragged_attention import ragged_attention

    torch.manual_seed(0)
    rows, slots = 6, 200
    query = torch.randn(rows, queries, heads, dim).transpose(1, 2)  # transformers' layout: a transposed view
    key, value = torch.randn(rows, kv_heads, slots, dim), torch.randn(rows, kv_heads, slots, dim)
    # the first query's slot: one slot; across a block boundary; one slot at a boundary; to the end; inside one
    # block; from slot 0 (a verification's later tokens run on past it, into the next block for some)
    bounds = torch.tensor([[0, 0], [3, 70], [64, 64], [10, slots - queries], [130, 150], [0, 127]])
    got = ragged_attention(query, key, value, bounds, dim ** -0.5)
    assert got.shape == (rows, queries, heads, dim), got.shape
    want = torch.cat([reference(query[:, :, j: j + 1], key, value, bounds + torch.tensor([0, j]), dim ** -0.5)
                      for j in range(queries)], dim=1)  # token j sees up to its own slot, first query's + j
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, diff
    print(f"max |kernel - sdpa| {diff:.2e} over {queries} query token(s) a row")


def decoder_against_sdpa(target_dir: str) -> None:
    from test_batch_decoding import QUESTIONS, rendered
    from transformers import AutoTokenizer

    from draftsmith.decoding.batch_target import BatchTarget
    from draftsmith.decoding.engine import generate
    from draftsmith.decoding.sampling import Sampling
    from draftsmith.decoding.target import TargetModel
    from draftsmith.target_model.spec import TargetSpec, stop_token_ids

    model = TargetSpec(target_dir).load_causal_lm(torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stops = stop_token_ids(tokenizer, model)
    prompts = rendered(tokenizer, QUESTIONS)
    ragged = BatchTarget(TargetModel(model), ragged=True)
    greedy = generate(ragged, prompts, 16, stops, 3, steps=2)
    assert greedy == generate(BatchTarget(TargetModel(model)), prompts, 16, stops, 3, steps=2)
    assert {reason for _, reason in greedy} == {"stop", "length"}  # rows end early and are refilled mid-decode
    sampling, seeds = Sampling(temperature=0.9, top_p=0.9), list(range(len(prompts)))
    assert generate(BatchTarget(TargetModel(model), ragged=True), prompts, 16, stops, 4, sampling, seeds) == \
        generate(BatchTarget(TargetModel(model)), prompts, 16, stops, 4, sampling, seeds)
    print(f"{len(prompts)} prompts: ragged answers equal SDPA's over the whole cache, greedy and sampled")


def verification_against_sdpa(target_dir: str) -> None:
    """Speculative decoding with ragged verifications (k + 1 tokens a row, the draft's auxiliary states too) and, for
    EAGLE-3, the draft's rounds through the ragged kernel too, gives the tokens, drafts and acceptances of SDPA over
    the whole cache, at one row and with rows refilled."""
    from test_batch_decoding import QUESTIONS, rendered
    from transformers import AutoTokenizer

    from draftsmith.decoding.batch_target import BatchTarget
    from draftsmith.decoding.engine import serve
    from draftsmith.decoding.engine_proposers import BatchEagle3Proposer, PromptLookupProposer
    from draftsmith.decoding.target import TargetModel
    from draftsmith.draft_model import build_draft
    from draftsmith.target_model.spec import TargetSpec, stop_token_ids

    spec = TargetSpec(target_dir)
    model = spec.load_causal_lm(torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stops = stop_token_ids(tokenizer, model)
    prompts = rendered(tokenizer, QUESTIONS)
    vocab = model.config.vocab_size
    aux = [0, 1, model.config.num_hidden_layers - 1]
    draft = build_draft(spec, torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool), 1, aux).eval()
    for concurrency in (1, 3):
        for name, proposer in (("EAGLE-3", lambda ragged: BatchEagle3Proposer(draft, ragged=ragged)),
                               ("prompt lookup", lambda ragged: PromptLookupProposer(2, model.device))):
            runs = [serve(BatchTarget(TargetModel(model, aux), ragged=ragged), proposer(ragged), prompts, concurrency, 3,
                          16, stops) for ragged in (True, False)]
            got, want = ([(t.tokens, t.proposed, t.accepted) for t in traces] for traces in runs)
            assert got == want, (name, concurrency)
            assert any(p for _, proposed, _ in got for p in proposed), name  # some rounds verified drafts
    print(f"{len(prompts)} prompts: ragged verifications equal SDPA's over the whole cache at 1 and 3 in flight")


def step_costs_ragged(target_dir: str) -> None:
    """The benchmark's step costs through the ragged path (the target's steps and the draft's rounds) at 1 and 3
    rows: every step runs, and each row decodes from its prompt's start."""
    from draftsmith.benchmark.step_costs import measure_step_costs
    from draftsmith.decoding.batch_target import BatchTarget
    from draftsmith.decoding.engine_proposers import BatchEagle3Proposer
    from draftsmith.decoding.target import TargetModel
    from draftsmith.draft_model import build_draft
    from draftsmith.target_model.spec import TargetSpec

    spec = TargetSpec(target_dir)
    model = spec.load_causal_lm(torch.float32).eval()
    vocab, aux = model.config.vocab_size, [0, 1, model.config.num_hidden_layers - 1]
    draft = build_draft(spec, torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool), 1, aux).eval()
    for rows in (1, 3):
        target = BatchTarget(TargetModel(model, aux), ragged=True)
        costs = measure_step_costs(target, BatchEagle3Proposer(draft, ragged=True), [5, 6, 7, 8, 9], 3, rows)
        assert min(costs["target_step_ms"], costs["verify_step_ms"], costs["draft_step_ms"]) > 0, costs
        assert target.rows.host_active == [True] * rows
    print("ragged step costs measured at 1 and 3 rows")


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    globals()[name](*[int(a) if a.isdigit() else a for a in args])
