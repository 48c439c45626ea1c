"""The engine as regenerate runs it (draftsmith.decoding.engine.generate: target-only, sampled, many rows with refill)
against transformers' own greedy `generate`, on real targets."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from draftsmith.decoding.batch_target import BatchTarget
from draftsmith.decoding.engine import generate
from draftsmith.decoding.sampling import Sampling, choose_tokens, nucleus_threshold, uniform_per_row
from draftsmith.decoding.target import TargetModel
from draftsmith.generation.hf_backend import HFBackend, compile_norms_and_mlps
from draftsmith.target_model.spec import TargetSpec, stop_token_ids

QUESTIONS = ["What is 12 + 7?", "What is the capital of France?", "Count from 3 to 9.", "Say hi.",
             "Reverse the order of these words: apple river stone", "List the first 4 multiples of 3.",
             "Write this in capital letters: green table", "What is 3 times 4? Answer, then say why, then stop.",
             "Sort these numbers: 9 2 7 4", "Name a colour.", "What comes after Monday?",
             "Spell the word table backwards, one letter at a time, and then count the letters."]


def rendered(tokenizer, questions) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
            for q in questions]


def generate_one(model, prompt: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], str]:
    """Plain greedy `generate` of one prompt (no padding), cut as the decoder cuts: the reference."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(stops),
                         pad_token_id=sorted(stops)[0])[0, len(prompt):].tolist()
    cut = next((i for i, t in enumerate(out) if t in stops), None)
    return (out, "length") if cut is None else (out[:cut], "stop")


class Decoder:
    """The engine over `model` as regenerate runs it: `rows` in flight, `steps` decode steps a round (a round of
    several read one round late), `options` of BatchTarget."""

    def __init__(self, model, rows: int, steps: int = 1, **options):
        self.engine, self.rows, self.steps = BatchTarget(TargetModel(model), **options), rows, steps

    def generate(self, prompts, max_new_tokens, stops, sampling=None, seeds=None):
        return generate(self.engine, prompts, max_new_tokens, stops, self.rows, sampling, seeds, self.steps)

    def record_prefills(self) -> list[list[list[int]]]:
        """The prompts of each prefill from now on (a list that grows)."""
        prefills, prefill = [], self.engine.prefill
        self.engine.prefill = lambda rows, prompts, with_aux=False: (prefills.append(prompts),
                                                                     prefill(rows, prompts, with_aux))[1]
        return prefills


@pytest.fixture(scope="module")
def tiny(tiny_target):
    spec = TargetSpec(str(tiny_target))
    model = spec.load_causal_lm(torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    return model, tokenizer, set(stop_token_ids(tokenizer, model))


@pytest.mark.parametrize("batch_size,steps", [(1, 1), (3, 1), (5, 4), (16, 2)])
def test_greedy_rows_equal_plain_generate_with_refill_and_early_stops(tiny, batch_size, steps):
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS)
    decoder = Decoder(model, batch_size, steps=steps)
    got = decoder.generate(prompts, 24, stops)
    with torch.inference_mode():
        want = [generate_one(model, p, 24, stops) for p in prompts]
    assert got == want
    reasons = {reason for _, reason in want}
    assert reasons == {"stop", "length"}  # rows end early and at the limit, so rows are refilled mid-decode
    assert len({len(p) for p in prompts}) > 5  # prompts of different lengths share the batch
    # the cache holds the longest prompt and its answer, no more (rows that decode on past their answer's end, unread
    # in a round of several steps, stay at its last slot): regenerate's batch of 2,048 rows fills a GPU
    assert decoder.engine.rows.cache.length == -(-(max(map(len, prompts)) + 24) // 64) * 64


def test_prefill_split_into_small_forwards_gives_the_same_answers(tiny):
    """A refill of many rows in forwards of at most `prefill_limit` tokens (rows x their longest prompt; here the longest
    prompt alone) decodes what one forward per refill decodes, greedy and sampled."""
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS)
    budget = max(map(len, prompts))
    sampling, seeds = Sampling(temperature=0.9, top_p=0.9), list(range(len(prompts)))
    split = Decoder(model, 8, prefill_limit=budget)
    whole = Decoder(model, 8)
    assert split.generate(prompts, 20, stops) == whole.generate(prompts, 20, stops)
    assert split.generate(prompts, 20, stops, sampling, seeds) == whole.generate(prompts, 20, stops, sampling, seeds)
    prefills = split.record_prefills()
    split.generate(prompts, 20, stops)
    forwards = [[len(p) for p in group] for group in prefills]
    assert forwards[0] == [budget] and sum(map(len, forwards)) == len(prompts)
    assert all(len(f) * max(f) <= budget for f in forwards) and max(map(len, forwards)) > 1
    with pytest.raises(ValueError, match="prefill_limit"):
        Decoder(model, 8, prefill_limit=0)


def test_rows_refilled_after_a_long_prompt_answer_as_generate_does(tiny):
    """A long prompt first (the queue takes the longest first), short ones after it: a short request refilled into
    the long one's row attends, through its mask, to none of the long request's entries left in the cache (every
    step reads the whole cache, sized for the long row); every row equals `generate`."""
    model, tokenizer, stops = tiny
    long_question = " ".join(QUESTIONS[:6]) + " Answer each question in turn."
    prompts = rendered(tokenizer, [long_question * 3, *QUESTIONS[:5]])
    assert len(prompts[0]) > 200 > 40 > max(len(p) for p in prompts[1:])
    decoder = Decoder(model, 2)
    got = decoder.generate(prompts, 20, stops)
    with torch.inference_mode():
        assert got == [generate_one(model, p, 20, stops) for p in prompts]
    assert decoder.engine.rows.cache.length >= 256


def test_the_decoder_counts_the_slots_busy_rows_fill(tiny):
    """One row alone, one step a round: each step's row fills its prompt plus the tokens before it; with many rows
    of different lengths the rows fill less than the cache the steps read (the slots a ragged read would skip)."""
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS)
    one = Decoder(model, 1)
    one.generate(prompts[:1], 12, stops)
    stats = one.engine.stats.copy()
    steps = stats["decode_steps"]
    assert stats["busy_row_steps"] == steps > 0
    assert stats["filled_slot_steps"] == sum(len(prompts[0]) + k for k in range(steps))
    one.generate(prompts[:1], 12, stops)  # the same call again: the difference of two readings is that call's share
    counts = {key: n for key, n in stats.items() if key != "refill_seconds"}  # the refills' wall time varies
    assert {key: n for key, n in (one.engine.stats - stats).items() if key != "refill_seconds"} == counts
    many = Decoder(model, 5, steps=2)
    many.generate(prompts, 12, stops)
    stats = many.engine.stats
    assert 0 < stats["busy_row_steps"] <= stats["decode_steps"] * 5
    assert 0 < stats["filled_slot_steps"] < stats["decode_steps"] * 5 * many.engine.rows.cache.length


def test_a_decoder_reused_for_another_chunk_of_other_lengths_gives_the_same_answers(tiny):
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS)
    decoder = Decoder(model, 4)
    first = decoder.generate(prompts[:5], 12, stops)
    longer = decoder.generate(prompts[5:], 30, stops)  # a longer cache: new state, same rows
    again = decoder.generate(prompts[:5], 12, stops)
    assert first == again
    assert longer == Decoder(model, 7).generate(prompts[5:], 30, stops)


def test_smollm2_grouped_query_attention_rows_equal_plain_generate(smollm2_target):
    """The embedded default (SmolLM2-135M-Instruct: 9 query heads share 3 KV heads) in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_target, torch_dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_target)
    stops = stop_token_ids(tokenizer, model)
    prompts = rendered(tokenizer, QUESTIONS[:6])
    got = Decoder(model, 4).generate(prompts, 16, stops)
    with torch.inference_mode():
        assert got == [generate_one(model, p, 16, stops) for p in prompts]


def test_a_repeated_prompt_shares_one_prefill_and_answers_as_if_alone(tiny):
    """Samples of one prompt (the same prompt in several rows, each with its seed) run its prefill once and copy the
    cache: each answer equals that prompt's answer decoded on its own, and the prefill counts each prompt once."""
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS[:4])
    sampling = Sampling(temperature=1.0, top_p=0.95)
    repeated = [p for p in prompts for _ in range(3)]
    seeds = [100 + i for i in range(len(repeated))]
    decoder = Decoder(model, 6, steps=2)
    got = decoder.generate(repeated, 20, stops, sampling, seeds)
    alone = [Decoder(model, 1).generate([p], 20, stops, sampling, [s])[0] for p, s in zip(repeated, seeds)]
    assert got == alone
    assert len({tuple(t) for t, _ in got[:3]}) > 1  # the samples differ: each row drew with its own seed
    assert decoder.engine.stats["prefill_tokens"] < sum(map(len, repeated))
    greedy = decoder.generate(repeated, 20, stops)
    assert greedy == [generate_one(model, p, 20, stops) for p in repeated]
    # prefill_limit counts distinct prompts: with room for one prompt a forward, each takes a prompt's three rows
    # (a batch that takes every request in its first refill)
    split = Decoder(model, len(repeated), steps=2, prefill_limit=max(map(len, prompts)))
    forwards = split.record_prefills()
    assert split.generate(repeated, 20, stops, sampling, seeds) == got
    assert sorted(len(group) for group in forwards) == [3] * len(prompts)
    assert all(len({tuple(p) for p in group}) == 1 for group in forwards)


def test_sampled_rows_depend_on_prompt_and_seed_only(tiny):
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS)
    sampling = Sampling(temperature=1.0, top_p=0.95, top_k=50)
    seeds = list(range(100, 100 + len(prompts)))
    one = Decoder(model, 3).generate(prompts, 20, stops, sampling, seeds)
    reversed_order = Decoder(model, 8, steps=3).generate(prompts[::-1], 20, stops, sampling, seeds[::-1])
    assert one == reversed_order[::-1]
    other_seeds = Decoder(model, 3).generate(prompts, 20, stops, sampling, [s + 1 for s in seeds])
    assert other_seeds != one
    greedy = Decoder(model, 3).generate(prompts, 20, stops)
    assert one != greedy


def test_the_compiled_token_choice_draws_what_the_eager_one_draws(tiny):
    """compile_sampler (regenerate's default on CUDA) runs torch.compile's kernels here on the CPU: the same draws."""
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS[:6])
    sampling, seeds = Sampling(temperature=0.8, top_p=0.9, top_k=40), list(range(6))
    compiled = Decoder(model, 4, compile_sampler=True)
    assert compiled.generate(prompts, 16, stops, sampling, seeds) == \
        Decoder(model, 4).generate(prompts, 16, stops, sampling, seeds)
    assert compiled.engine._choose_fn is not choose_tokens  # compiled, not fallen back to the eager function


def test_compiled_layers_give_the_eager_greedy_answers(tiny_target, tiny):
    """compile_norms_and_mlps (regenerate's default on CUDA) compiles the model's RMSNorm and MLP modules in place (a
    model of its own here)."""
    _, tokenizer, stops = tiny
    model = TargetSpec(str(tiny_target)).load_causal_lm(torch.float32).eval()
    prompts = rendered(tokenizer, QUESTIONS[:6])
    want = Decoder(model, 4).generate(prompts, 16, stops)
    compile_norms_and_mlps(model)
    assert Decoder(model, 4).generate(prompts, 16, stops) == want
    compiled = [m for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]
    assert compiled and all(m._compiled_call_impl is not None for m in compiled)


def test_a_token_choice_that_fails_to_compile_falls_back_to_the_eager_one(tiny, caplog):
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS[:4])
    sampling, seeds = Sampling(temperature=0.8, top_p=0.9), list(range(4))
    decoder = Decoder(model, 4, compile_sampler=True)

    def broken_compiler_output(*args):  # stands in for a torch.compile that raises on its first call
        raise RuntimeError("no C++ compiler")

    decoder.engine._choose_fn = broken_compiler_output
    assert decoder.generate(prompts, 12, stops, sampling, seeds) == \
        Decoder(model, 4).generate(prompts, 12, stops, sampling, seeds)
    assert decoder.engine._choose_fn is choose_tokens and "torch.compile of the token choice failed" in caplog.text


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.7, top_k=1), Sampling(temperature=0.7, top_p=1e-6)])
def test_sampling_cut_to_the_most_likely_token_is_greedy(tiny, sampling):
    model, tokenizer, stops = tiny
    prompts = rendered(tokenizer, QUESTIONS[:6])
    assert Decoder(model, 4).generate(prompts, 16, stops, sampling, list(range(6))) == \
        Decoder(model, 4).generate(prompts, 16, stops)


def test_the_per_row_uniforms_are_uniform_and_differ_by_seed_and_step():
    seeds = torch.arange(200_000) % 1000
    steps = torch.arange(200_000) // 1000
    u = uniform_per_row(seeds, steps)
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert float((counts / counts.mean() - 1).abs().max()) < 0.03
    assert len(set(u.tolist())) > 196_000  # (seed, step) pairs give their own numbers (23 bits: ~2.4k collide)
    assert torch.equal(u, uniform_per_row(seeds, steps))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99, 0.9999])
def test_the_bisected_nucleus_is_the_sorted_one(top_p):
    """The tokens kept are those the sort-based definition keeps: the most likely, up to and including the one whose
    cumulative mass first exceeds top_p (random peaked and flat rows, and rows a top-k cut left 50 tokens of)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(64, 5000, generator=g) * 4, torch.randn(64, 5000, generator=g) * 0.1])
    cut = torch.randn(32, 5000, generator=g) * 2
    logits = torch.cat([logits, cut.masked_fill(cut < cut.topk(50).values[:, -1:], float("-inf"))])
    probs = logits.double().softmax(-1)  # float64: the two sums then agree at the boundary token
    kept = probs.log() >= nucleus_threshold(probs.log(), top_p)
    ordered, order = probs.sort(-1, descending=True)
    before = ordered.cumsum(-1) - ordered
    reference = torch.zeros_like(kept).scatter(-1, order, before <= top_p)
    assert torch.equal(kept, reference)


def test_sampled_tokens_follow_the_distribution():
    """Many rows drawing from one known distribution: the frequencies match it (and top-k/top-p cut it)."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(40_000, 4)
    seeds, steps = torch.arange(40_000), torch.zeros(40_000, dtype=torch.long)
    counts = torch.bincount(choose_tokens(logits, Sampling(temperature=1.0), seeds, steps), minlength=4) / 40_000
    assert torch.allclose(counts, probs, atol=0.01)
    cut = torch.bincount(choose_tokens(logits, Sampling(temperature=1.0, top_p=0.7), seeds, steps), minlength=4)
    assert cut[2:].sum() == 0 and abs(float(cut[0]) / 40_000 - 0.5 / 0.8) < 0.01
    top1 = choose_tokens(logits, Sampling(temperature=1.0, top_k=1), seeds, steps)
    assert bool((top1 == 0).all())


def test_the_hf_backend_answers_alike_through_the_engine_and_generate(tiny_target):
    """An SDPA model takes the engine; the same weights with eager attention (as a model the engine cannot
    take) go through left-padded `generate`: the same greedy answers."""
    spec = TargetSpec(str(tiny_target))
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    model = spec.load_causal_lm(torch.float32).eval()
    stops = sorted(stop_token_ids(tokenizer, model))
    requests = [{"prompt_ids": p, "seed": 0} for p in rendered(tokenizer, QUESTIONS)]
    gen = {"max_new_tokens": 20, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop_ids": stops,
           "pad_id": stops[0]}
    batched = HFBackend(spec, {"batch_size": 4}, model=model)
    eager = spec.load_causal_lm(torch.float32).eval()
    eager.config._attn_implementation = "eager"
    padded = HFBackend(spec, {"batch_size": 4}, model=eager)
    got = batched.generate(requests, gen)
    assert batched.engine is not None and padded.engine is None
    assert got == padded.generate(requests, gen)
    assert padded.engine is None


def test_bad_arguments_are_named(tiny):
    model, tokenizer, stops = tiny
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        Decoder(model, 0).generate(rendered(tokenizer, QUESTIONS[:1]), 8, stops)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Decoder(model, 2, cuda_graphs=True)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        Decoder(model, 2).generate(rendered(tokenizer, QUESTIONS[:1]), 0, stops)
    eager = type(model)._from_config(model.config, attn_implementation="eager")
    with pytest.raises(ValueError, match="full-attention SDPA"):
        Decoder(eager, 2)
