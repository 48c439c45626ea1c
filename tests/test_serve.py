"""Batched greedy and speculative decoding (draftsmith.decoding.engine) must give every row its batch-1 greedy
output exactly (float32, CPU), whatever else shares the batch: prompts of different lengths, rows that stop early.

The tiny target and drafts are test_decoding's fixture (hidden 64, 6 layers, an untrained and a briefly trained
EAGLE-3 draft)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import test_decoding as spec_tests
import torch

from draftsmith.decoding.engine_proposers import BatchEagle3Proposer, NoDrafts
from draftsmith.decoding.batch_target import BatchTarget
from draftsmith.decoding.engine import serve
from draftsmith.benchmark.methods import ProposerSettings, method_decoders, method_proposers
from draftsmith.benchmark.results import trace_counts, trace_latency
from draftsmith.decoding.reference import greedy_decode
from draftsmith.decoding.static_cache import prompt_bucket

tiny = spec_tests.tiny  # the module-scoped fixture, built once for this module too
MAX_NEW = spec_tests.MAX_NEW


def references(tiny, prompts, stop):
    return [greedy_decode(tiny["target"], ids, MAX_NEW, stop).tokens for ids in prompts]


def batch_of(tiny, size: int) -> tuple[list[list[int]], set[int]]:
    """`size` prompts of different lengths (the fixture's, cut by 3 tokens more each: from 58 down to 9 tokens) and
    the stop tokens, at which some rows stop early (the second does) while others run to max_new_tokens."""
    prompts = [ids[: len(ids) - 3 * i] for i, ids in enumerate(tiny["prompts"][:size])]
    assert len({len(p) for p in prompts}) == size
    return prompts, tiny["stop"]


def check_rows(traces, want, k: int | None = None):
    assert [t.tokens for t in traces] == want
    for trace, tokens in zip(traces, want):
        if k is None:  # greedy: one forward per token
            assert trace.target_forwards == len(tokens) and trace.proposed == []
            continue
        assert all(0 <= a <= p <= k for a, p in zip(trace.accepted, trace.proposed))
        assert trace.target_forwards == 1 + len(trace.proposed)
        # the prompt's token, then each round's accepted drafts and bonus token; the stopping rule may cut the last
        emitted = 1 + sum(a + 1 for a in trace.accepted)
        assert len(tokens) <= emitted < len(tokens) + k + 1
        trace_counts(trace, k)  # the row fields the benchmark writes (checks the counts again)


def serve_greedy(target, prompts, concurrency, stop):
    return serve(target, NoDrafts(), prompts, concurrency, 3, MAX_NEW, stop)


@pytest.mark.parametrize("concurrency", [1, 2, 3, 5])
def test_greedy_under_load_gives_every_request_its_batch_one_output(tiny, concurrency):
    """5 prompts of different lengths with 1, 2, 3 or 5 in flight: rows that end early take the next prompt (refill)
    into a row whose cache holds the last request's entries; every output equals batch-1 greedy's."""
    prompts, stop = batch_of(tiny, 5)
    want = references(tiny, prompts, stop)
    assert any(len(w) < MAX_NEW for w in want) and any(len(w) == MAX_NEW for w in want)  # early stops and the limit
    check_rows(serve_greedy(BatchTarget(tiny["target"]), prompts, concurrency, stop), want)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("concurrency", [1, 2, 3, 5])
@pytest.mark.parametrize("method", ["prompt_lookup", "untrained_draft", "eagle3_draft", "hybrid"])
def test_speculative_decoding_under_load_equals_batch_one(tiny, method, concurrency, k):
    prompts, stop = batch_of(tiny, 5)
    want = references(tiny, prompts, stop)
    # the benchmark's own proposers and decoders of the method (the tiny fixture's drafts under their method names)
    settings = ProposerSettings(torch.device("cpu"), 3, {"untrained_draft": tiny["untrained"],
                                                         "eagle3_draft": tiny["trained"]}, hybrid_min_ngram=2)

    def decoder(target, batched):
        proposers = method_proposers([method], dataclasses.replace(settings, batched=batched))
        return method_decoders([method], target, proposers, k, MAX_NEW, stop,
                               concurrency=concurrency if batched else None)[method]

    traces = decoder(BatchTarget(tiny["target"]), batched=True)(prompts)
    check_rows(traces, want, k)
    # each row drafts what it drafts alone: the same proposals and acceptances as batch-1 speculative decoding
    alone = decoder(tiny["target"], batched=False)
    assert [(t.proposed, t.accepted) for t in traces] == [(t.proposed, t.accepted) for t in map(alone, prompts)]
    if method == "eagle3_draft" and k == 3:  # rows accept partial chains: the rewinds are exercised
        accepted = [a for t in traces for a in t.accepted]
        assert 0 < sum(accepted) and any(0 < a < k for a in accepted)


@pytest.mark.parametrize("method", ["greedy", "eagle3_draft"])
def test_buffers_reused_run_after_run_leak_nothing(tiny, method):
    """One BatchTarget (and draft) serves runs of other widths and concurrencies in turn, as the benchmark's runs
    reuse the buffers of their row count (and the steps captured on them): each run's requests still equal their
    batch-1 greedy outputs, though the cache holds the earlier runs' entries."""
    stop = tiny["stop"]
    long_batch, _ = batch_of(tiny, 3)
    short_batch = [ids[:9 + 2 * i] for i, ids in enumerate(tiny["prompts"][2:5])]
    pair = [tiny["prompts"][3][:20], tiny["prompts"][4]]
    target = BatchTarget(tiny["target"])
    proposer = BatchEagle3Proposer(tiny["trained"])
    target.reserve(3, 8)  # too small: begin grows it
    for prompts, concurrency in [(long_batch, 3), (short_batch, 2), (pair, 2), (long_batch, 3), (short_batch, 3)]:
        if method == "greedy":
            check_rows(serve_greedy(target, prompts, concurrency, stop), references(tiny, prompts, stop))
        else:
            traces = serve(target, proposer, prompts, concurrency, 3, MAX_NEW, stop)
            check_rows(traces, references(tiny, prompts, stop), 3)
    assert sorted(target.buffers.by_rows) == [2, 3]


def test_cuda_graphs_need_a_cuda_device(tiny):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        BatchTarget(tiny["target"], cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        BatchEagle3Proposer(tiny["trained"], cuda_graphs=True)


def test_a_row_past_its_cache_is_a_clear_error(tiny):
    target = BatchTarget(tiny["target"])
    prompts, _ = batch_of(tiny, 2)
    width = max(len(p) for p in prompts)
    target.begin(2, width + 2)
    target.prefill([0, 1], prompts)
    target.advance([target.rows.cache.length - width, 0])
    with pytest.raises(ValueError, match="target's batched KV cache holds"):
        target.forward(torch.zeros((2, 1), dtype=torch.long))
    with pytest.raises(ValueError, match="a prompt of"):
        target.prefill([0], [[1] * (target.rows.cache.length + 1)])


@pytest.mark.parametrize("drafting", [False, True])
def test_refills_wait_for_their_idle_budget_and_give_the_same_outputs(tiny, drafting):
    """`refill_rounds`: free rows wait for the next prompts until their idle row-rounds reach that many rounds of every
    row. At 0 a row takes the next prompt as it comes free; with a budget no row's idleness reaches, only when every
    row is free or the queue's rest fits the free rows: fewer refills, each of more rows. The outputs stay batch 1's."""
    prompts, stop = batch_of(tiny, 5)
    prompts = prompts + prompts[::-1] + prompts[1::2]
    want = references(tiny, prompts, stop)
    refills = {}
    for budget in (0.0, 1.0, 1e6):
        target = BatchTarget(tiny["target"])
        proposer = BatchEagle3Proposer(tiny["trained"]) if drafting else NoDrafts()
        traces = serve(target, proposer, prompts, 3, 3, MAX_NEW, stop, refill_rounds=budget)
        check_rows(traces, want, 3 if drafting else None)
        refills[budget] = target.stats["refills"]
        assert target.stats["refill_seconds"] > 0
    assert refills[0.0] > refills[1e6] >= 3  # the first fill, then every row free or the queue's rest fitting
    assert refills[0.0] >= refills[1.0] >= refills[1e6]


def test_requests_share_the_run_s_wall_time_and_keep_their_own_latency(tiny):
    """Under load a request's `seconds` is its share of the run's wall time (summed: the run's throughput); its time to
    first token counts from its admission (a refilled request: when its row came free), its time per output token
    after that."""
    prompts, stop = batch_of(tiny, 5)
    traces = serve_greedy(BatchTarget(tiny["target"]), prompts, 2, stop)
    assert len({t.seconds for t in traces}) == 1 and traces[0].seconds > 0
    for trace in traces:
        latency = trace_latency(trace)
        assert latency == {"ttft_seconds": trace.ttft_seconds, "tpot_seconds": trace.tpot_seconds}
        assert trace.ttft_seconds > 0 and (trace.tpot_seconds > 0 or len(trace.tokens) == 1)
        # no request takes longer than the whole run: its first token, then every later one
        assert trace.ttft_seconds + trace.tpot_seconds * (len(trace.tokens) - 1) <= trace.seconds * len(traces) + 1e-6


@pytest.mark.parametrize("drafting", [False, True])
def test_progress_counts_each_answer_once_in_a_report_a_round_or_refill(tiny, drafting):
    """`progress(n)`: n more answers done, every answer counted exactly once, and reported once a round (and once a
    refill, for answers its first token ends) rather than once an answer: the rows that run to max_new_tokens side by
    side end in the same round and come in one report."""
    prompts, stop = batch_of(tiny, 5)
    proposer = BatchEagle3Proposer(tiny["trained"]) if drafting else NoDrafts()
    calls: list[int] = []
    traces = serve(BatchTarget(tiny["target"]), proposer, prompts, 5, 3, MAX_NEW, stop, progress=calls.append)
    assert sum(calls) == len(prompts) == len(traces) and min(calls) >= 1
    if not drafting:  # one token a round for every row: those cut at the limit end together
        at_limit = sum(len(t.tokens) == MAX_NEW for t in traces)
        assert at_limit >= 2 and max(calls) >= at_limit


def test_offline_benchmark_sweeps_batch_sizes(tiny):
    """benchmark.batch_sizes [1, 2] on the offline backend: every method at both sizes, rows tagged with their size,
    per_batch_size and pays_up_to in the summary, and every size's outputs equal to target-only greedy's."""
    import pandas as pd

    from draftsmith.benchmark.offline import run_offline_benchmark
    from draftsmith.config.batch_sizes import batch_size_problems
    from draftsmith.data.prompts import load_prompts
    from draftsmith.target_model.spec import TargetSpec

    draft_dir = tiny["root"] / "draft_sizes"
    tiny["trained"].save_pretrained(draft_dir)
    cfg = {"backend": "offline", "num_speculative_tokens": 2, "max_new_tokens": 10, "temperature": 0.0,
           "batch_size": None, "batch_sizes": [1, 2], "prompt_lookup_ngram": 3, "device": "cpu", "dtype": "float32",
           "seed": 0, "cuda_graphs": "auto", "repeats": 2, "load_requests_per_row": 2,
           "methods": ["target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft"]}
    assert batch_size_problems(cfg) == []
    assert batch_size_problems({**cfg, "batch_sizes": [2, 1]}) != []  # still ascending only
    prompts = load_prompts(tiny["root"] / "heldout.jsonl", 3)
    out = tiny["root"] / "bench_sizes"
    summary = run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts, cfg,
                                    out / "per_prompt.csv", out / "summary.json", "default")
    assert summary == json.loads((out / "summary.json").read_text()) and summary["batch_sizes"] == [1, 2]
    rows = pd.read_csv(out / "per_prompt.csv")
    assert sorted(rows.groupby("batch_size").size().items()) == [(1, 12), (2, 12)]  # 3 prompts, 4 methods
    for method, entry in summary["methods"].items():
        assert set(entry["per_batch_size"]) == {"1", "2"}
        for size, figures in entry["per_batch_size"].items():
            sized = rows[(rows["method"] == method) & (rows["batch_size"] == int(size))]
            assert figures["tokens_per_s"] == pytest.approx(sized["new_tokens"].sum() / sized["seconds"].sum())
            assert figures["acceptance_length"] == pytest.approx(
                sized["new_tokens"].sum() / sized["target_forwards"].sum())
            if method != "target_greedy":
                assert figures["lossless"] is True and figures["mismatched_prompts"] == []
        if method != "target_greedy":
            assert "pays_up_to" in entry and entry["lossless"] is True
    # 2 in flight x 2 requests a row: 4 requests, so the 3 prompts in 2 whole passes; one row per prompt, its
    # requests agreeing (repeatable), tokens/s over all 6 requests' tokens and the run's wall time
    assert {e["per_batch_size"]["2"]["requests"] for e in summary["methods"].values()} == {6}
    assert "requests" not in summary["methods"]["eagle3_draft"]["per_batch_size"]["1"]
    # each EAGLE-3 draft's step costs with the size's rows at once (batch 1's stay on the method itself)
    for method in ("eagle3_draft", "untrained_draft"):
        costs = summary["methods"][method]["per_batch_size"]["2"]["step_costs"]
        assert costs["verify_step_ms"] > 0 and costs["cost_ratio"] == pytest.approx(
            costs["draft_step_ms"] / costs["target_step_ms"])
        assert "step_costs" not in summary["methods"][method]["per_batch_size"]["1"]
    assert "step_costs" not in summary["methods"]["prompt_lookup"]["per_batch_size"]["2"]
    # each method's refills a run (the first fill among them) and their share of the run's wall time; auto without
    # CUDA graphs refills at once
    assert summary["refill_rounds"] == 0.0
    for entry in summary["methods"].values():
        figures = entry["per_batch_size"]["2"]
        assert figures["refills"] >= 2 and 0 < figures["refill_share"] < 1
    assert all(e["repeatable"] for e in summary["methods"].values())
    assert summary["methods"]["target_greedy"]["per_batch_size"]["2"]["speedup"] == pytest.approx(1.0)
    assert summary["methods"]["target_greedy"]["per_batch_size"]["2"]["matches_batch_1"] is True
    # every size decodes the same tokens with the same counts
    keyed = rows.set_index(["method", "prompt_id", "batch_size"])
    for (method, pid), g in rows.groupby(["method", "prompt_id"]):
        assert keyed.loc[(method, pid, 1), "new_tokens"] == keyed.loc[(method, pid, 2), "new_tokens"]
        assert keyed.loc[(method, pid, 1), "accepted_tokens"] == keyed.loc[(method, pid, 2), "accepted_tokens"]
    # one size above 1 (batch_size 2 alone): no batch-1 run at all, the same tokens
    two = run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts,
                                {**cfg, "batch_sizes": None, "batch_size": 2, "repeats": 1}, out / "two.csv",
                                out / "two.json", "default")
    assert two["batch_sizes"] == [2] and set(pd.read_csv(out / "two.csv")["batch_size"]) == {2}
    for method, entry in two["methods"].items():
        assert list(entry["per_batch_size"]) == ["2"]
        assert entry["acceptance_length"] == summary["methods"][method]["per_batch_size"]["2"]["acceptance_length"]
        assert method == "target_greedy" or entry["lossless"] is True
    with pytest.raises(ValueError, match="batch_sizes"):
        run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts,
                              {**cfg, "batch_sizes": [0, 2]}, out / "x.csv", out / "x.json", "default")
    with pytest.raises(ValueError, match="refill_rounds must be auto or a number >= 0, got -1"):
        run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts,
                              {**cfg, "refill_rounds": -1}, out / "x.csv", out / "x.json", "default")
    with pytest.raises(ValueError, match="load_requests_per_row must be >= 1"):
        run_offline_benchmark(TargetSpec(str(tiny["target_dir"])), str(draft_dir), prompts,
                              {**cfg, "load_requests_per_row": 0}, out / "x.csv", out / "x.json", "default")


@pytest.mark.parametrize("concurrency", [2, 3])
def test_prefills_padded_to_buckets_and_replayed_give_the_same_outputs(tiny, concurrency):
    """With CUDA graphs a refill's prompts are left-padded to their bucket and the target's and the draft's prefills
    are replayed from a capture per (buffers' rows, rows, width). Here on the CPU through the recorder
    (test_decoding.EagerStepRecorder, a mock of the capture, named as such: CI has no GPU) that keeps each shape's
    first inputs at fixed addresses, as a graph does: every request still gets its batch-1 greedy output, and the
    prefills come in a few padded widths, keyed apart from batch 1's (a graph writes the cache it was captured on)."""
    prompts, stop = batch_of(tiny, 5)
    target = BatchTarget(tiny["target"])
    proposer = BatchEagle3Proposer(tiny["trained"])
    target.buffers.graphs, proposer.buffers.graphs = spec_tests.EagerStepRecorder(), spec_tests.EagerStepRecorder()
    assert [t.tokens for t in serve(target, proposer, prompts[:1], 1, 3, MAX_NEW, stop)] == [tiny["greedy"][0].tokens]
    traces = serve(target, proposer, prompts, concurrency, 3, MAX_NEW, stop)
    check_rows(traces, references(tiny, prompts, stop), 3)
    # the same drafts as the engine run eagerly at the prompts' own widths: a replayed prefill wrote each row's own
    # draft cache (an index bound into the step rather than passed as its input would replay the first call's rows)
    eager = serve(BatchTarget(tiny["target"]), BatchEagle3Proposer(tiny["trained"]), prompts, concurrency, 3, MAX_NEW,
                  stop)
    assert [t.accepted for t in traces] == [t.accepted for t in eager]
    prefills = [key for key in target.buffers.graphs.steps if key[0] == "prefill"]
    buckets = {prompt_bucket(len(p)) for p in prompts}  # the widths: buckets, not the prompts' own lengths
    assert prefills and {width for *_, width, _ in prefills} <= buckets < {len(p) for p in prompts} | buckets
    # batch 1's, then at `concurrency` in flight the first fill and refills of one row, each on its own buffers
    assert {rows for _, rows, _, _, _ in prefills} == {1, concurrency}
    assert {(1, 1), (concurrency, concurrency), (concurrency, 1)} <= {key[1:3] for key in prefills}
    draft_prefills = [key for key in proposer.buffers.graphs.steps if key[0] == "prefill"]
    assert {(rows, width + 1) for _, _, rows, width in draft_prefills} == {key[2:4] for key in prefills}
    check_rows(serve_greedy(target, prompts, concurrency, stop), references(tiny, prompts, stop))


def test_a_prompt_s_requests_merge_into_one_row_and_must_agree():
    """per_prompt: the requests of one prompt (a load run's passes) become its row: the first's trace and times, each
    run's latency the median of the requests', repeatable only where every request emitted the same tokens."""
    from draftsmith.benchmark.interleaved import Timed, per_prompt
    from draftsmith.decoding.trace import Trace

    def timed(tokens, ttft):
        trace = Trace(tokens=tokens, target_forwards=len(tokens), seconds=0.5, ttft_seconds=ttft, tpot_seconds=0.01)
        t = Timed(trace)
        t.add(trace, 0, 3)
        return t

    merged = per_prompt([timed([1, 2], 0.1), timed([7], 0.2), timed([1, 2], 0.3), timed([1, 2], 0.5)],
                        ["a", "b", "a", "a"], 3)
    assert list(merged) == ["a", "b"] and merged["a"].trace.tokens == [1, 2] and merged["a"].seconds == [0.5]
    assert merged["a"].latencies == [{"ttft_seconds": 0.3, "tpot_seconds": 0.01}] and merged["a"].repeatable
    assert not per_prompt([timed([1, 2], 0.1), timed([1, 3], 0.1)], ["a", "a"], 3)["a"].repeatable
