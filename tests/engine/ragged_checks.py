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


def kernel_against_sdpa(heads: int, kv_heads: int, dim: int) -> None:
    from draftsmith.decoding.ragged_attention import ragged_decode_attention

    torch.manual_seed(0)
    rows, slots = 6, 200
    query = torch.randn(rows, 1, heads, dim).transpose(1, 2)  # transformers' layout: a transposed view
    key, value = torch.randn(rows, kv_heads, slots, dim), torch.randn(rows, kv_heads, slots, dim)
    # one slot; across a block boundary; one slot at a boundary; to the end; inside one block; from slot 0
    bounds = torch.tensor([[0, 0], [3, 70], [64, 64], [10, slots - 1], [130, 150], [0, 127]])
    got = ragged_decode_attention(query, key, value, bounds, dim ** -0.5)
    assert got.shape == (rows, 1, heads, dim), got.shape
    diff = (got - reference(query, key, value, bounds, dim ** -0.5)).abs().max().item()
    assert diff < 1e-5, diff
    print(f"max |kernel - sdpa| {diff:.2e}")


def decoder_against_span(target_dir: str) -> None:
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
    assert set(ragged.span_steps) == {ragged.rows.cache.length}  # one step shape: each row reads its own slots
    sampling, seeds = Sampling(temperature=0.9, top_p=0.9), list(range(len(prompts)))
    assert generate(BatchTarget(TargetModel(model), ragged=True), prompts, 16, stops, 4, sampling, seeds) == \
        generate(BatchTarget(TargetModel(model)), prompts, 16, stops, 4, sampling, seeds)
    print(f"{len(prompts)} prompts: ragged answers equal the span path's, greedy and sampled")


if __name__ == "__main__":
    name, *args = sys.argv[1:]
    globals()[name](*[int(a) if a.isdigit() else a for a in args])
