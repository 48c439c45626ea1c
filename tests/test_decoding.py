"""Speculative decoding must reproduce target-only greedy decoding exactly, for every proposer.

Runs on a tiny embedded target built here (hidden 64, 6 layers, briefly pretrained on the
synthetic corpus) with real speculators EAGLE-3 drafts: an untrained one and one trained
briefly below on the target's own hidden states.
"""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from draftsmith.benchmark.step_costs import kernel_profile, measure_step_costs
from draftsmith.decoding.engine_proposers import BatchEagle3Proposer, HybridProposer, NoDrafts, PromptLookupProposer
from draftsmith.decoding.batch_kv import prefill_layout
from draftsmith.decoding.batch_target import AdmittedPrompts, BatchTarget
from draftsmith.decoding.engine import serve
from draftsmith.decoding.sampling import Sampling
from draftsmith.decoding.ngrams import ContextNgrams, NgramIndex, prompt_lookup_candidates
from draftsmith.decoding.target import TargetModel
from draftsmith.decoding.reference import greedy_decode, speculative_decode
from draftsmith.data.prompts import load_prompts
from draftsmith.data.synthetic import generate_corpus
from draftsmith.decoding.draft_kernels import RotaryTable, draft_layers, fuse_rms_norms, tabulate_rotary, use_sdpa
from draftsmith.decoding.static_cache import CapturedStep, StepGraphs, prompt_bucket
from draftsmith.draft_model import build_draft
from draftsmith.io import write_jsonl
from draftsmith.target_model.embedded import build_embedded_target
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vocab import build_vocab_map

AUX = [1, 3, 4]
MAX_NEW = 24
TARGET_CFG = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128, "num_layers": 6, "num_heads": 4,
    "num_kv_heads": 2, "max_position_embeddings": 512, "pretrain_steps": 100, "pretrain_lr": 0.003,
    "pretrain_batch_size": 8, "pretrain_seq_len": 96,  # enough steps for varied answers, not one repeated token
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared 2-core machine
    root = tmp_path_factory.mktemp("spec_decode")
    train, heldout = generate_corpus(200, 5, seed=0)
    target_dir = root / "target"
    target_dir.mkdir()
    build_embedded_target([r["messages"] for r in train], TARGET_CFG, seed=0, out_dir=target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    sequences = [tokenizer.apply_chat_template(r["messages"], tokenize=True) for r in train]
    freq = Counter(t for ids in sequences for t in ids)
    d2t, t2d = build_vocab_map(dict(freq), 192, len(tokenizer))
    write_jsonl(root / "heldout.jsonl", heldout)
    prompts = [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True)
               for p in load_prompts(root / "heldout.jsonl", 5)]
    model = AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa").eval()
    target = TargetModel(model, AUX)
    assert target.static  # full-attention SDPA: the engine (static KV cache, the path CUDA graphs capture) can take it
    untrained = build_draft(TargetSpec(str(target_dir)), torch.from_numpy(d2t), torch.from_numpy(t2d), 1, AUX, seed=0).eval()
    trained = build_draft(TargetSpec(str(target_dir)), torch.from_numpy(d2t), torch.from_numpy(t2d), 1, AUX, seed=1)
    train_step0(trained, target, sequences[:48], steps=80)
    stop = {tokenizer.eos_token_id}
    return {
        "root": root, "target_dir": target_dir, "tokenizer": tokenizer, "target": target, "prompts": prompts,
        "stop": stop, "untrained": untrained, "trained": trained,
        "greedy": [greedy_decode(target, ids, MAX_NEW, stop) for ids in prompts],
    }


def train_step0(draft, target: TargetModel, sequences: list[list[int]], steps: int) -> None:
    """Teacher-forced training of the draft's first step: from (x[t+1], aux states at t) predict the
    target's greedy token after x[t+1]. Enough for a draft whose proposals are often accepted."""
    use_sdpa(draft)
    draft_index = torch.cumsum(draft.t2d.long(), 0) - 1  # target id -> draft id where t2d is set
    data = []
    for ids in sequences:
        with torch.inference_mode():
            logits, aux = target.start(ids, with_aux=True, keep=len(ids))
        labels = logits.argmax(-1)[1:]
        labels = torch.where(draft.t2d[labels], draft_index[labels], -100)
        data.append((torch.tensor([ids[1:]]), aux[:, :-1].clone(), labels.clone()))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=3e-3)
    draft.train()
    for step in range(steps):
        tokens, aux, labels = data[step % len(data)]
        # the whole sequence at once, no cache, laid out as a prompt's prefill (EAGLE-3: position ids one past slots)
        slots, causal, positions = prefill_layout(torch.zeros(1, dtype=torch.long), tokens.shape[1])
        hidden = draft_layers(draft, tokens, draft.fc(aux), positions + 1, slots, causal, None)
        loss = torch.nn.functional.cross_entropy(draft.lm_head(draft.norm(hidden))[0], labels, ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    draft.eval()


def test_prompt_lookup_prefers_the_longest_ngram_and_its_earliest_match():
    context = [1, 2, 3, 9, 2, 3, 7, 8, 5, 1, 2, 3]
    # the 3-gram [1, 2, 3] occurs at 0: its continuation is proposed, not that of the 2-gram [2, 3] at 4
    assert prompt_lookup_candidates(context, 3, max_ngram=3) == [9, 2, 3]
    assert prompt_lookup_candidates(context, 2, max_ngram=2) == [9, 2]  # [2, 3] first occurs at 1
    assert prompt_lookup_candidates([4, 5, 6, 5], 3, max_ngram=3) == [6, 5]  # only 1-gram [5] recurs
    assert prompt_lookup_candidates([4, 5, 6, 7], 3, max_ngram=3) == []
    assert prompt_lookup_candidates([4], 3, max_ngram=3) == []
    assert prompt_lookup_candidates(context, 3, max_ngram=3, min_ngram=3) == [9, 2, 3]
    assert prompt_lookup_candidates([4, 5, 6, 5], 3, max_ngram=3, min_ngram=2) == []  # a 1-gram is too short


def test_the_incremental_ngram_index_answers_what_the_scan_answers():
    """NgramIndex, extended a few tokens at a time as decoding extends a context, proposes what a scan of the whole
    context proposes, at every length, for every n-gram bound; ContextNgrams starts over for a new context list."""
    import random

    rng = random.Random(0)
    for trial in range(60):
        alphabet, max_ngram = rng.choice([2, 3, 5, 20]), rng.choice([1, 2, 3, 4])
        index, context = NgramIndex(max_ngram), []
        while len(context) < 80:
            new = [rng.randrange(alphabet) for _ in range(rng.randint(1, 5))]
            context += new
            index.extend(new)
            for min_ngram in range(1, max_ngram + 1):
                for k in (1, 3):
                    assert index.candidates(k, min_ngram) == prompt_lookup_candidates(context, k, max_ngram, min_ngram)
    held, first, second = ContextNgrams(3), [1, 2, 3, 1, 2], [7, 1, 2, 3, 1, 2]
    assert held.candidates(0, first, 3) == [3, 1, 2]
    first += [3]
    assert held.candidates(0, first, 3) == [1, 2, 3]  # extended in place: the same index, brought up to date
    assert held.candidates(0, second, 3) == [3, 1, 2] and held.candidates(1, [5], 3) == []  # a new list, a new row


def start(proposer, next_tokens: torch.Tensor, aux: torch.Tensor) -> None:
    """A one-row proposer's prompt from the draft's inputs: next_tokens[t] = x[t+1] at the prompt's positions t, the
    first generated token last; aux [1, P, 3H] the target's states at them."""
    next_tokens = next_tokens.view(1, -1)
    ids = torch.cat([next_tokens[:, -1:], next_tokens[:, :-1]], dim=1)  # x[0], which the draft never reads: any token
    proposer.begin(1, ids.shape[1] + 16)  # the prompt and a few rounds' drafts
    starts = torch.zeros(1, dtype=torch.long)
    proposer.prefill([0], AdmittedPrompts(ids, starts, ids.shape[1] - 1, aux), next_tokens[:, -1])


def drafts(proposer, context: list[int], k: int = 3) -> list[int]:
    """A one-row proposer's drafts for `context` (its count of them: the tensor's width)."""
    drafted, counts = proposer.propose([context], k)
    assert counts == [drafted.shape[1]]
    return drafted[0].tolist()


def test_the_hybrid_drafts_with_lookup_where_an_ngram_recurs_and_with_the_draft_elsewhere(tiny):
    """Each round the hybrid's EAGLE-3 round runs (the draft sees every verified token); its drafts are prompt lookup's
    where the context's last min_ngram+ tokens recur, the draft's own elsewhere; either way decoding stays lossless."""
    target, stop = tiny["target"], tiny["stop"]
    hybrid = HybridProposer(PromptLookupProposer(3, target.device), BatchEagle3Proposer(tiny["trained"]), min_ngram=2)
    alone = BatchEagle3Proposer(tiny["trained"])
    prompt = tiny["prompts"][0]
    with torch.inference_mode():
        logits, aux = target.start(prompt, with_aux=True)
        first = logits[-1].argmax().view(1)
        for proposer in (hybrid, alone):
            start(proposer, torch.cat([torch.tensor(prompt[1:]), first]), aux)
        repeat = prompt + prompt[:2]  # its last 2 tokens recur at the prompt's start
        assert drafts(hybrid, repeat) == prompt[2:5]
        drafts(alone, repeat)  # the prompt's round, whose drafts the hybrid replaced
        fresh = prompt + [int(first)]
        assert not prompt_lookup_candidates(fresh, 3, 3, min_ngram=2)
        for proposer in (hybrid, alone):  # a new round after one verified token: the draft's own chain
            proposer.accept(first[None], aux[:, -1:], [1])
        assert drafts(hybrid, fresh) == drafts(alone, fresh)
        # a lookup round after a verification feeds the draft its verified input without the chain: the round after
        # it drafts what a draft that ran every chain drafts
        for proposer in (hybrid, alone):
            proposer.accept(first[None], aux[:, -1:], [1])
        assert drafts(hybrid, repeat) == prompt[2:5]
        drafts(alone, repeat)
        for proposer in (hybrid, alone):
            proposer.accept(first[None], aux[:, -1:], [1])
        assert drafts(hybrid, fresh) == drafts(alone, fresh)
    assert hybrid.rounds == {"prompt_lookup": 2, "eagle3": 2}
    with pytest.raises(ValueError, match="hybrid_min_ngram must be within 1..prompt_lookup_ngram"):
        HybridProposer(PromptLookupProposer(3, target.device), alone, min_ngram=4)
    used = Counter()
    for ids, greedy in zip(tiny["prompts"], tiny["greedy"]):
        for k in (1, 3):
            hybrid = HybridProposer(PromptLookupProposer(3, target.device), BatchEagle3Proposer(tiny["trained"]), 2)
            _check_trace(speculative_decode(target, hybrid, ids, k, MAX_NEW, stop), greedy, k)
            used.update(hybrid.rounds)
    assert used["prompt_lookup"] > 0 and used["eagle3"] > 0  # both sources drafted rounds


def test_draft_chain_matches_speculators_training_forward(tiny):
    """Our cached chain (step 0 over the context, then k-1 chain steps) predicts what speculators'
    Eagle3DraftModel.forward (the TTT loop it trains) predicts at the same position and step."""
    tokenizer = tiny["tokenizer"]
    d2t, t2d = tiny["untrained"].d2t, tiny["untrained"].t2d
    draft = build_draft(TargetSpec(str(tiny["target_dir"])), d2t, t2d, 1, AUX, seed=3).eval()
    torch.manual_seed(0)
    with torch.no_grad():  # spread the lm_head so that argmaxes differ between positions and steps
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight))
    seq = 128  # FlexAttention's block size
    aux = torch.randn(1, seq, 3 * draft.hidden_size)
    input_ids = torch.randint(0, len(tokenizer), (1, seq))
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        reference = draft(hidden_states=aux, input_ids=input_ids, ttt_steps=3)  # draft vocabulary ids
    assert len({tuple(r[0].tolist()) for r in reference}) == 3  # the steps really differ
    proposer = BatchEagle3Proposer(draft)
    for t in [0, 1, 7, 64, 127]:
        with torch.inference_mode():
            start(proposer, input_ids[0, : t + 1], aux[:, : t + 1])
            chain = drafts(proposer, [])
        expected = [int(r[0, t] + d2t[r[0, t]]) for r in reference]
        assert chain == expected, f"position {t}"


def _check_trace(trace, greedy, k):
    assert trace.tokens == greedy.tokens
    assert trace.target_forwards == 1 + len(trace.proposed) <= greedy.target_forwards
    assert all(0 <= a <= p <= k for a, p in zip(trace.accepted, trace.proposed))
    # every round emits its accepted drafts plus one target token; the stopping rule may cut the last round
    emitted = 1 + sum(a + 1 for a in trace.accepted)
    assert len(trace.tokens) <= emitted < len(trace.tokens) + k + 1


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", ["prompt_lookup", "untrained_draft", "trained_draft"])
def test_speculative_decoding_is_lossless(tiny, method, k):
    target, stop = tiny["target"], tiny["stop"]
    proposers = {
        "prompt_lookup": lambda: PromptLookupProposer(3, target.device),
        "untrained_draft": lambda: BatchEagle3Proposer(tiny["untrained"]),
        "trained_draft": lambda: BatchEagle3Proposer(tiny["trained"]),
    }
    for ids, greedy in zip(tiny["prompts"], tiny["greedy"]):
        assert greedy.target_forwards == len(greedy.tokens) and greedy.proposed == [0] * (len(greedy.tokens) - 1)
        trace = speculative_decode(target, proposers[method](), ids, k, MAX_NEW, stop)
        _check_trace(trace, greedy, k)


def test_a_target_without_full_attention_sdpa_decodes_in_the_reference_loops_alike(tiny):
    """A target whose masks draftsmith cannot build (here: eager attention) is not the engine's: the reference loops
    decode it (the benchmark's batch 1 for such a target) with the same tokens and the same acceptance."""
    eager = AutoModelForCausalLM.from_pretrained(tiny["target_dir"], attn_implementation="eager").eval()
    dynamic = TargetModel(eager, AUX)
    assert not dynamic.static and tiny["target"].static
    stop = tiny["stop"]
    for ids, greedy in zip(tiny["prompts"], tiny["greedy"]):
        assert greedy_decode(dynamic, ids, MAX_NEW, stop).tokens == greedy.tokens
        sdpa = speculative_decode(tiny["target"], BatchEagle3Proposer(tiny["trained"]), ids, 3, MAX_NEW, stop)
        other = speculative_decode(dynamic, BatchEagle3Proposer(tiny["trained"]), ids, 3, MAX_NEW, stop)
        assert other.tokens == greedy.tokens and other.accepted == sdpa.accepted
    with pytest.raises(ValueError, match="the engine needs a full-attention SDPA target"):
        BatchTarget(dynamic)


class EagerStepRecorder(StepGraphs):
    """Stand-in for CUDA-graph capture on the CPU (a mock, named as such: CI has no GPU): it records each step's
    key the way StepGraphs captures it and, like CapturedStep, keeps the first call's function and static copies of
    its inputs that later calls copy into; then it runs that first function eagerly on them (a key's first call
WARM_UP_RUNS times more, as a capture's warm-up does). So, as with a graph,
    whatever a later call binds into its function rather than passing as an input is ignored.
    test_cuda_graph_replay_gives_the_eager_steps_tokens checks the same property with real graphs on a GPU."""

    def __init__(self):
        super().__init__(enabled=True)

    def run(self, key, fn, *inputs):
        captured = key in self.steps
        first, static = self.steps.setdefault(key, (fn, [x.clone() for x in inputs]))
        for s, x in zip(static, inputs):
            s.copy_(x)
        for _ in range(0 if captured else CapturedStep.WARM_UP_RUNS):  # the capture's warm-up runs, for real
            first(*static)
        return first(*static)


def engine(tiny, recorded: bool = False):
    """The engine's target and the trained draft's proposer; `recorded`: their steps through EagerStepRecorder."""
    target, proposer = BatchTarget(tiny["target"]), BatchEagle3Proposer(tiny["trained"])
    if recorded:
        target.buffers.graphs, proposer.buffers.graphs = EagerStepRecorder(), EagerStepRecorder()
    return target, proposer


def one(target, proposer, ids, stop, k=3):
    """One request through the engine: the benchmark's batch 1."""
    return serve(target, proposer, [ids], 1, k, MAX_NEW, stop)[0]


def test_steps_over_a_cache_mostly_empty_decode_as_the_reference_does(tiny):
    """An engine step attends to the whole cache through its rows' masks: decodes of a 118- and a 261-token prompt
    in a 1024-slot cache (most of its slots never written, or holding the prompt's padding past the write slot) give
    the tokens and the accepted drafts of the reference loops over transformers' DynamicCache, with one captured step
    per shape."""
    target, proposer = engine(tiny, recorded=True)
    target.reserve(1, 1024)  # as the benchmark does: no cache grows (which would drop the recorded steps)
    proposer.reserve(1, 1024)
    stop, long = tiny["stop"], sum(tiny["prompts"], [])
    for length in (118, 261):
        ids = (long * 10)[:length]
        greedy = one(target, NoDrafts(), ids, stop)
        assert greedy.tokens == greedy_decode(tiny["target"], ids, MAX_NEW, stop).tokens
        a = one(target, proposer, ids, stop)
        b = speculative_decode(tiny["target"], BatchEagle3Proposer(tiny["trained"]), ids, 3, MAX_NEW, stop)
        assert (a.tokens, a.accepted) == (b.tokens, b.accepted) and a.tokens == greedy.tokens
        assert len(greedy.tokens) == MAX_NEW
    steps = {key for key in target.buffers.graphs.steps if key[0] != "prefill"}
    assert steps == {("decode", 1, Sampling()), (1, 4, True)}  # greedy's step, a verification: at any length
    assert target.rows.cache.length == 1024


def test_one_engine_decodes_prompts_longer_than_its_cache_so_far(tiny):
    """The engine's caches grow (and drop their captured steps) when a longer sequence comes: the same target and
    proposer then decode a short prompt, a long one and the short one again exactly as fresh ones do."""
    target, proposer = engine(tiny)
    stop, short = tiny["stop"], tiny["prompts"][0]
    long = (short * 400)[:300]
    first = one(target, proposer, short, stop)
    sizes = (target.rows.cache.length, proposer.rows.cache.length)
    traces = [one(target, proposer, ids, stop) for ids in (long, short)]
    assert target.rows.cache.length > sizes[0] >= len(short) + MAX_NEW and proposer.rows.cache.length > sizes[1]
    assert traces[0].tokens == greedy_decode(tiny["target"], long, MAX_NEW, stop).tokens
    assert traces[1].tokens == first.tokens and traces[1].accepted == first.accepted


def test_the_warm_up_captures_every_step_shape_the_timed_loops_use(tiny):
    """BatchTarget.capture / BatchEagle3Proposer.capture request every step shape that decoding one request with k
    drafts takes (the benchmark's batch 1): prompts padded to a few buckets (one shape per prompt length would put
    captures inside timed decodes), the target's steps and the draft rounds; every method then decodes each
    prompt as the reference loops do, its prompt padded, capturing nothing more."""
    target, proposer = engine(tiny, recorded=True)
    longest = max(len(ids) for ids in tiny["prompts"])
    target.reserve(1, 1024)
    proposer.reserve(1, 1024)
    target.capture(1, 3, longest)
    proposer.capture(1, 3, longest)
    captured = (set(target.buffers.graphs.steps), set(proposer.buffers.graphs.steps))
    buckets = {prompt_bucket(n) for n in range(1, longest + 1)}
    assert 16 in buckets and prompt_bucket(longest) >= longest and len(buckets) <= 4
    assert captured == ({(1, q, aux) for q in range(1, 5) for aux in (False, True)}
                        | {("decode", 1, Sampling())}  # target-only greedy's step
                        | {("prefill", 1, 1, b, aux) for b in buckets for aux in (False, True)},
                        {(1, n, chain) for n in range(1, 5) for chain in (3, 0)}
                        | {("prefill", 1, 1, b - 1) for b in buckets})  # the draft's: its inputs but the last
    stop = tiny["stop"]
    lookup = PromptLookupProposer(3, target.device)
    hybrid = HybridProposer(lookup, proposer, min_ngram=2)
    for ids, greedy in zip(tiny["prompts"], tiny["greedy"]):
        padded = one(target, proposer, ids, stop)
        reference = speculative_decode(tiny["target"], BatchEagle3Proposer(tiny["trained"]), ids, 3, MAX_NEW, stop)
        assert padded.tokens == greedy.tokens and padded.accepted == reference.accepted  # the same drafts, too
        assert 0 < padded.ttft_seconds < padded.seconds and 0 < padded.tpot_seconds
        assert one(target, lookup, ids, stop).tokens == greedy.tokens
        assert one(target, NoDrafts(), ids, stop).tokens == greedy.tokens
        assert one(target, hybrid, ids, stop).tokens == greedy.tokens
    assert (set(target.buffers.graphs.steps), set(proposer.buffers.graphs.steps)) == captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("ragged", [False, True])
def test_cuda_graph_replay_gives_the_eager_steps_tokens(tiny, ragged):
    """On a GPU, in float32: every method with its steps replayed as CUDA graphs (the target's and the draft's
    attention SDPA through masks, or the ragged kernel) gives the same tokens and the same accepted drafts as the
    engine run eagerly through masks, at batch 1 and with 3 in flight; captured up front (as the benchmark's warm-up
    does), one request at a time captures nothing more."""
    model = AutoModelForCausalLM.from_pretrained(tiny["target_dir"], attn_implementation="sdpa").cuda().eval()
    runner = TargetModel(model, AUX)
    eager, graphed = BatchTarget(runner), BatchTarget(runner, cuda_graphs=True, ragged=ragged)
    drafts = [tiny[name].to("cuda") for name in ("untrained", "trained")]
    stop, prompts = tiny["stop"], tiny["prompts"]
    longest = max(len(ids) for ids in prompts)
    captured_before = set()
    for concurrency in (1, 3):
        graphed.reserve(concurrency, 1024)
        graphed.capture(concurrency, 3, longest)
        methods = [(NoDrafts(), NoDrafts()),
                   (PromptLookupProposer(3, eager.device), PromptLookupProposer(3, graphed.device))]
        for draft in drafts:
            replayed = BatchEagle3Proposer(draft, cuda_graphs=True, ragged=ragged)
            replayed.reserve(concurrency, 1024)
            replayed.capture(concurrency, 3, longest)
            methods.append((BatchEagle3Proposer(draft), replayed))
        captured = set(graphed.buffers.graphs.steps)
        # each row count has its own one-row prefills: a graph writes the cache it was captured on, so a refill at 3 in
        # flight replaying batch 1's would write a cache of one row (past it: a device-side assert)
        assert {("prefill", concurrency, 1)} == {key[:3] for key in captured - captured_before if key[0] == "prefill"}
        captured_before = captured
        for plain, replayed in methods:  # twice the prompts: rows come free at different rounds, refilled one by one
            a = serve(eager, plain, prompts * 2, concurrency, 3, MAX_NEW, stop)
            b = serve(graphed, replayed, prompts * 2, concurrency, 3, MAX_NEW, stop)
            assert [(t.tokens, t.accepted) for t in b] == [(t.tokens, t.accepted) for t in a]
        if concurrency == 1:  # refills of one row: every prefill shape was captured
            assert set(graphed.buffers.graphs.steps) == captured
    for name in ("untrained", "trained"):
        tiny[name].to("cpu")


def test_step_costs_time_rows_admitted_as_serve_admits_them(tiny):
    """The step costs with N rows at once: every row holds the prompt and decodes (as `serve` admits a request: a
    ragged step reads a row's slots from its start only while the row decodes), and every time is measured; the
    refill starts row 0's request over (the target's and the draft's) and leaves row 1's as it was."""
    target = BatchTarget(TargetModel(tiny["target"].model, AUX))
    proposer = BatchEagle3Proposer(tiny["trained"])
    costs = measure_step_costs(target, proposer, tiny["prompts"][0], 3, rows=2)
    assert target.rows.host_active == [True, True] and target.rows.active.tolist() == [True, True]
    assert target.rows.host_starts == [0, 0]  # one prompt, both rows at the same slots
    prompt_end = len(tiny["prompts"][0])
    assert proposer.rows.host_lengths[0] == prompt_end - 1 < prompt_end + 3 <= proposer.rows.host_lengths[1]
    assert min(costs["target_step_ms"], costs["verify_step_ms"], costs["draft_step_ms"], costs["refill_ms"]) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (run on the GPU machine)")
def test_cuda_graph_step_costs_name_each_steps_kernels(tiny):
    """On a GPU the step costs profile each step's kernels: a replayed step runs the same kernels every call, and its
    most costly are listed by time, within the count."""
    model = AutoModelForCausalLM.from_pretrained(tiny["target_dir"], attn_implementation="sdpa").cuda().eval()
    target = BatchTarget(TargetModel(model, AUX), cuda_graphs=True)
    try:
        proposer = BatchEagle3Proposer(tiny["trained"].to("cuda"), cuda_graphs=True)
        costs = measure_step_costs(target, proposer, tiny["prompts"][0], 3)
        with torch.inference_mode():
            step = torch.zeros((1, 4), dtype=torch.long, device="cuda")
            counts = {kernel_profile(lambda: target.forward(step, with_aux=True))["count"] for _ in range(3)}
    finally:
        tiny["trained"].to("cpu")
    assert len(counts) == 1 and counts.pop() > 0
    for name in ("target_step", "verify_step", "draft_round", "refill"):
        kernels = costs["kernels"][name]
        assert kernels["count"] > 0 and kernels["us"] > 0 and kernels["top"]
        assert [k["us"] for k in kernels["top"]] == sorted((k["us"] for k in kernels["top"]), reverse=True)
        assert sum(k["calls"] for k in kernels["top"]) <= kernels["count"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (run on the GPU machine)")
@pytest.mark.parametrize("ragged", [False, True])
def test_regenerate_decoder_cuda_graph_replay_gives_the_eager_tokens(tiny, ragged):
    """On a GPU, in float32: the engine as regenerate runs it (`generate`: target-only, its decode steps replayed as
    CUDA graphs, SDPA over the whole cache through masks or the ragged kernel, prefills eager) gives the tokens of
    the same engine run eagerly, greedy and sampled, 15 prompts on 3 rows refilled as answers end, 2 steps a round
    (read one round late)."""
    from draftsmith.decoding.engine import generate

    model = AutoModelForCausalLM.from_pretrained(tiny["target_dir"], attn_implementation="sdpa").cuda().eval()
    prompts, stop = tiny["prompts"] * 3, tiny["stop"]
    for sampling, seeds in ((None, None), (Sampling(temperature=0.9, top_p=0.9), list(range(len(prompts))))):
        answers = [generate(BatchTarget(TargetModel(model), cuda_graphs=graphs, ragged=ragged, capture_prefills=False),
                            prompts, MAX_NEW, stop, 3, sampling, seeds, steps=2) for graphs in (False, True)]
        assert answers[1] == answers[0] and len(answers[0]) == len(prompts)


def as_built(draft):
    """`draft` with its RMSNorms' own forward and its own rotary embedding again (undoing what the proposers apply:
    BatchEagle3Proposer's fewer_kernels)."""
    for module in draft.modules():
        module.__dict__.pop("forward", None)
    if isinstance(draft.rotary_emb, RotaryTable):
        draft.rotary_emb = draft.rotary_emb.rotary
    return draft


@torch.inference_mode()
def test_fewer_draft_kernels_compute_what_the_draft_s_own_modules_do(tiny):
    """The proposers run the draft's Llama RMSNorms (4 in a one-layer EAGLE-3 draft) through PyTorch's fused
    rms_norm and look its rotary embedding up in a table: on the tiny draft in float32 every norm's output matches the
    module's own forward (the speculators classes), the table gives the rotary module's own cos and sin (clamped
    past its length), and a proposer's rounds draft the same tokens either way."""
    own = as_built(copy.deepcopy(tiny["trained"]))
    fewer = copy.deepcopy(own)
    assert fuse_rms_norms(fewer) == 4 == sum(isinstance(m, LlamaRMSNorm) for m in fewer.modules())
    assert fuse_rms_norms(fewer) == 4 and tabulate_rotary(fewer) and tabulate_rotary(fewer)
    hidden = torch.randn(1, 5, fewer.fc.out_features)
    norms = [(m, t) for m, t in zip(fewer.modules(), own.modules()) if isinstance(m, LlamaRMSNorm)]
    for mine, theirs in norms:
        assert "forward" in vars(mine) and "forward" not in vars(theirs)
        torch.testing.assert_close(mine(hidden), theirs(hidden), rtol=1e-6, atol=1e-6)
        assert mine(hidden.double()).dtype == theirs(hidden.double()).dtype == torch.float64
    table = fewer.rotary_emb
    assert isinstance(table, RotaryTable) and table.rotary is not own.rotary_emb
    last = table.length - 1
    positions = torch.tensor([[0, 1, 7, last]])
    for mine, theirs in zip(table(hidden, positions), own.rotary_emb(hidden, positions)):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(table(hidden, torch.tensor([[last + 5]])), own.rotary_emb(hidden, torch.tensor([[last]]))):
        assert torch.equal(mine, theirs)
    H = fewer.fc.in_features
    for ids in tiny["prompts"]:
        tokens = torch.tensor([ids[1:]])
        aux = torch.randn(1, len(ids) - 1, H, generator=torch.Generator().manual_seed(len(ids)))
        rounds = []
        for keep_own in (True, False):
            draft = copy.deepcopy(own)
            proposer = BatchEagle3Proposer(draft, fewer_kernels=not keep_own)
            assert isinstance(draft.rotary_emb, RotaryTable) != keep_own
            start(proposer, tokens, aux)
            first = proposer.propose([[]], 3)[0]
            proposer.accept(first[:, :2], aux[:, -2:], [2])
            rounds.append(torch.cat([first, proposer.propose([[]], 3)[0]], dim=1))
        assert torch.equal(rounds[0], rounds[1]), (ids, rounds)


def test_training_buys_acceptance(tiny):
    target, stop = tiny["target"], tiny["stop"]
    accepted = {}
    for name in ("untrained", "trained"):
        traces = [speculative_decode(target, BatchEagle3Proposer(tiny[name]), ids, 3, MAX_NEW, stop)
                  for ids in tiny["prompts"]]
        accepted[name] = sum(sum(t.accepted) for t in traces) / sum(len(t.proposed) for t in traces)
    assert accepted["trained"] > max(0.5, 2 * accepted["untrained"]), accepted


def test_generation_stops_at_eos_and_at_max_new_tokens(tiny):
    target, tokenizer = tiny["target"], tiny["tokenizer"]
    ids = tiny["prompts"][0]
    long = greedy_decode(target, ids, MAX_NEW, stop_ids=set())
    assert len(long.tokens) == MAX_NEW
    stop = {long.tokens[5]}  # pretend the sixth token ends the answer
    first = next(i for i, t in enumerate(long.tokens) if t in stop)
    for trace in (greedy_decode(target, ids, MAX_NEW, stop),
                  speculative_decode(target, PromptLookupProposer(3, target.device), ids, 3, MAX_NEW, stop),
                  speculative_decode(target, BatchEagle3Proposer(tiny["trained"]), ids, 3, MAX_NEW, stop)):
        assert trace.tokens == long.tokens[: first + 1]
    assert tokenizer.eos_token_id in tiny["stop"]


def test_a_divergence_from_greedy_is_located_and_sized(tiny):
    from draftsmith.benchmark.divergence import divergence_gap, first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 5, 3], [1, 2, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    target, ids, reference = tiny["target"], tiny["prompts"][0], tiny["greedy"][0].tokens
    assert divergence_gap(target, ids, list(reference), reference) is None
    logits = target.model(torch.tensor([ids + reference[:3]])).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    emitted = reference[:3] + [runner_up] + reference[4:]
    gap = divergence_gap(target, ids, emitted, reference)
    assert gap["position"] == 3 and (gap["greedy_token"], gap["emitted_token"]) == (reference[3], runner_up)
    assert gap["logit_gap"] == pytest.approx(float(logits[reference[3]] - logits[runner_up]), abs=1e-5)
    assert gap["logit_gap"] > 0  # in float32 the greedy token is the argmax


def test_offline_benchmark_writes_every_method_and_checks_losslessness(tiny):
    from draftsmith.benchmark.offline import run_offline_benchmark
    from draftsmith.draft_model import (
        load_draft,  # noqa: F401  (the loader the benchmark uses)
    )

    draft_dir = tiny["root"] / "draft"
    tiny["trained"].save_pretrained(draft_dir)
    cfg = {"backend": "offline", "num_speculative_tokens": 2, "max_new_tokens": 12, "num_prompts": 3,
           "prompts": "heldout", "temperature": 0.0, "batch_size": 1, "prompt_lookup_ngram": 3, "device": "cpu",
           "dtype": "float32", "seed": 0, "cuda_graphs": "auto", "repeats": 2,
           "hybrid_min_ngram": 2, "methods": ["target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft",
                                              "hybrid"]}
    prompts = load_prompts(tiny["root"] / "heldout.jsonl", 3)
    out = tiny["root"] / "bench"
    summary = run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts, cfg, out / "per_prompt.csv",
                                    out / "summary.json", "default")
    assert summary == json.loads((out / "summary.json").read_text())
    for method in ("prompt_lookup", "untrained_draft", "eagle3_draft", "hybrid"):
        assert summary["methods"][method]["lossless"] is True
        assert summary["methods"][method]["mismatched_prompts"] == [] and summary["methods"][method]["divergences"] == {}
    assert set(summary["methods"]) == {"target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft", "hybrid"}
    # the target's norms fused for every method alike (2 a layer and the final one), and every method still lossless
    assert summary["target_norms_fused"] == 2 * TARGET_CFG["num_layers"] + 1
    drafted_by = summary["methods"]["hybrid"]["rounds_drafted_by"]  # the warm-up's and every timed run's rounds
    assert set(drafted_by) == {"prompt_lookup", "eagle3"} and sum(drafted_by.values()) > 0
    assert summary["methods"]["target_greedy"]["acceptance_length"] == 1.0
    methods = summary["methods"]
    assert methods["eagle3_draft"]["acceptance_length"] > methods["untrained_draft"]["acceptance_length"]
    for method in ("untrained_draft", "eagle3_draft"):  # the cost ratio c and the bound tau / (1 + k c)
        costs = methods[method]["step_costs"]
        assert costs["draft_step_ms"] > 0 and costs["target_step_ms"] > 0 and costs["verify_step_ms"] > 0
        assert costs["cost_ratio"] == pytest.approx(costs["draft_step_ms"] / costs["target_step_ms"])
        assert "kernels" not in costs  # the profile of each step's kernels runs on a GPU alone
        assert methods[method]["ideal_speedup"] == pytest.approx(
            methods[method]["acceptance_length"] / (1 + 2 * costs["cost_ratio"]))
        assert methods[method]["round_model_speedup"] == pytest.approx(methods[method]["acceptance_length"] / (
            costs["verify_step_ms"] / costs["target_step_ms"] + 2 * costs["cost_ratio"]))
    assert "step_costs" not in methods["prompt_lookup"] and "step_costs" not in methods["target_greedy"]
    import pandas as pd

    rows = pd.read_csv(out / "per_prompt.csv")
    assert len(rows) == 3 * 5 and list(rows.columns[-2:]) == ["accept_pos_1", "accept_pos_2"]
    assert set(rows["category"]) == {p["category"] for p in prompts}  # the synthetic task families
    for category, stats in methods["eagle3_draft"]["per_category"].items():
        g = rows[(rows["method"] == "eagle3_draft") & (rows["category"] == category)]
        assert stats["acceptance_length"] == pytest.approx(g["new_tokens"].sum() / g["target_forwards"].sum())
    # timing: two runs per prompt and method, interleaved, the order rotated by one per prompt and per run
    assert (rows["repeats"] == 2).all() and summary["repeats"] == 2 and summary["timing"] == "interleaved"
    for _, row in rows.iterrows():
        runs = [float(x) for x in row["repeat_seconds"].split()]
        assert len(runs) == 2 and row["seconds"] == pytest.approx(sorted(runs)[0] / 2 + sorted(runs)[1] / 2)
        assert row["time_spread"] == pytest.approx((max(runs) - min(runs)) / row["seconds"])
    order = {(r["prompt_id"], r["method"]): [int(x) for x in r["run_order"].split()] for _, r in rows.iterrows()}
    pids = list(dict.fromkeys(rows["prompt_id"]))
    names = ["target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft", "hybrid"]
    for i, pid in enumerate(pids):
        for run in range(2):  # run r of prompt i starts with method (i + r) mod 5, then the rest in turn
            assert sorted(names, key=lambda m: order[(pid, m)][run]) == names[(i + run) % 5:] + names[:(i + run) % 5]
    firsts = {m for (pid, m), positions in order.items() for p in positions if p == 0}
    assert firsts == {names[(i + run) % 5] for i in range(3) for run in range(2)}  # 4 of 5 lead a run, none always
    for method in names:
        entry = methods[method]
        assert entry["repeatable"] is True and entry["unrepeatable_prompts"] == []
        assert len(entry["speedup_by_repeat"]) == 2
        low, high = entry["speedup_range"]
        assert low <= entry["speedup"] <= high and low <= min(entry["speedup_by_repeat"])
        assert entry["time_spread"] == pytest.approx(rows[rows["method"] == method]["time_spread"].median())
    only = run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts,
                                 {**cfg, "methods": ["target_greedy", "eagle3_draft"], "repeats": 1}, out / "two.csv",
                                 out / "two.json", "default")
    assert list(only["methods"]) == ["target_greedy", "eagle3_draft"]
    assert only["methods"]["eagle3_draft"]["speedup_range"] is None  # one run: the spread is unknown, not zero
    assert only["methods"]["eagle3_draft"]["acceptance_length"] == methods["eagle3_draft"]["acceptance_length"]
    with pytest.raises(ValueError, match="lack target_greedy"):
        run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts,
                              {**cfg, "methods": ["eagle3_draft"]}, out / "x.csv", out / "x.json", "default")
    with pytest.raises(ValueError, match="batch_size"):
        run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts, {**cfg, "batch_sizes": [0, 2]},
                              out / "x.csv", out / "x.json", "default")
    with pytest.raises(ValueError, match=r"benchmark methods \['medusa'\] are unknown"):
        run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts,
                              {**cfg, "methods": ["target_greedy", "medusa"]}, out / "x.csv", out / "x.json", "default")
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts, {**cfg, "repeats": 0},
                              out / "x.csv", out / "x.json", "default")


def test_mt_bench_second_turn_follows_the_targets_own_answer(tiny):
    """benchmark.mt_bench.turns = 2: each question's second turn is benchmarked after the target's greedy answer."""
    import pandas as pd

    from draftsmith.benchmark.offline import run_offline_benchmark
    from draftsmith.data.mtbench import mt_bench_questions_file
    from draftsmith.data.prompts import resolve_benchmark_prompts

    draft_dir = tiny["root"] / "draft_turns"
    tiny["trained"].save_pretrained(draft_dir)
    spec = {"source": "mt_bench", "path": str(mt_bench_questions_file()), "per_category": 1, "seed": 0, "turns": 2}
    prompts = resolve_benchmark_prompts(spec)[:2]
    assert all(isinstance(p["follow_up"], str) and p["follow_up"] for p in prompts)
    cfg = {"backend": "offline", "num_speculative_tokens": 2, "max_new_tokens": 8, "temperature": 0.0, "batch_size": 1,
           "prompt_lookup_ngram": 3, "device": "cpu", "dtype": "float32", "seed": 0, "cuda_graphs": "auto", "repeats": 1,
           "methods": ["target_greedy", "eagle3_draft"]}
    out = tiny["root"] / "bench_turns"
    summary = run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts, cfg,
                                    out / "per_prompt.csv", out / "summary.json", "default")
    assert summary["num_prompts"] == 4 and summary["methods"]["eagle3_draft"]["prompts"] == 4
    assert summary["methods"]["eagle3_draft"]["lossless"] is True
    rows = pd.read_csv(out / "per_prompt.csv")
    greedy = rows[rows["method"] == "target_greedy"].set_index("prompt_id")
    first, second = prompts[0]["prompt_id"], prompts[0]["prompt_id"] + "_turn2"
    assert list(greedy.index) == [first, second, prompts[1]["prompt_id"], prompts[1]["prompt_id"] + "_turn2"]
    assert greedy.loc[second, "category"] == prompts[0]["category"]
    # the second turn's prompt: the first turn, the target's own greedy answer to it, then the follow-up
    tokenizer, target = tiny["tokenizer"], tiny["target"]
    turn1 = tokenizer.apply_chat_template(prompts[0]["messages"], add_generation_prompt=True, tokenize=True)
    answer = tokenizer.decode(greedy_decode(target, turn1, 8, tiny["stop"]).tokens, skip_special_tokens=True).strip()
    turn2 = tokenizer.apply_chat_template([*prompts[0]["messages"], {"role": "assistant", "content": answer},
                                           {"role": "user", "content": prompts[0]["follow_up"]}],
                                          add_generation_prompt=True, tokenize=True)
    assert answer and greedy.loc[first, "prompt_tokens"] == len(turn1) and greedy.loc[second, "prompt_tokens"] == len(turn2)


def test_num_speculative_tokens_auto_is_what_the_draft_was_trained_for(tiny):
    from draftsmith.draft_model import resolve_num_speculative_tokens

    draft_dir = tiny["root"] / "draft_steps"
    trained = tiny["trained"]
    build_draft(TargetSpec(str(tiny["target_dir"])), trained.d2t.cpu(), trained.t2d.cpu(), 1, AUX,
                num_speculative_tokens=4).save_pretrained(draft_dir)  # as if trained with ttt_steps = 4
    assert resolve_num_speculative_tokens("auto", draft_dir) == 4
    assert resolve_num_speculative_tokens(5, draft_dir) == 5
    config = json.loads((draft_dir / "config.json").read_text())
    del config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    (draft_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: speculators_config.proposal_methods\[0\].speculative_tokens"):
        resolve_num_speculative_tokens("auto", draft_dir)
