"""Benchmark metric arithmetic on hand-made decoding traces, through draftsmith.benchmark.results."""

from __future__ import annotations

import json
import math
import statistics

import pandas as pd
import pytest

from draftsmith.benchmark.results import trace_counts, write_results
from draftsmith.decoding.trace import Trace, cut_output

K = 3


def row(method: str, prompt_id: str, trace: Trace) -> dict:
    return {"variant": "v", "backend": "offline", "method": method, "prompt_id": prompt_id, "category": "all",
            "prompt_tokens": 7, **trace_counts(trace, K)}


def traces() -> list[dict]:
    # prompt a: greedy makes 10 tokens in 10 forwards (1 s). Speculative: the prefill makes 1 token, then
    # five rounds accept 3, 1, 0, 0 (nothing proposed) and 0 drafts, each plus the target's own token:
    # 1 + 4 + 2 + 1 + 1 + 1 = 10 tokens in 6 forwards (0.5 s).
    # The first token (the prompt's forward) takes 0.1 s on a and 0.5 s on b for both methods.
    greedy_a = Trace(tokens=list(range(10)), target_forwards=10, seconds=1.0, first_token_seconds=0.1)
    spec_a = Trace(tokens=list(range(10)), target_forwards=6, proposed=[3, 3, 3, 0, 3], accepted=[3, 1, 0, 0, 0],
                   seconds=0.5, first_token_seconds=0.1)
    # prompt b: greedy 4 tokens in 4 forwards (2 s); speculative: 1 + (2 + 1) = 4 tokens in 2 forwards (1 s)
    greedy_b = Trace(tokens=[1, 2, 3, 4], target_forwards=4, seconds=2.0, first_token_seconds=0.5)
    spec_b = Trace(tokens=[1, 2, 3, 4], target_forwards=2, proposed=[3], accepted=[2], seconds=1.0,
                   first_token_seconds=0.5)
    return [row("target_greedy", "a", greedy_a), row("eagle3_draft", "a", spec_a),
            row("target_greedy", "b", greedy_b), row("eagle3_draft", "b", spec_b)]


def test_trace_counts_follow_the_row_definitions():
    spec_a = traces()[1]
    assert spec_a["drafts"] == 4  # the round without a proposal is not a draft
    assert spec_a["draft_tokens"] == 12 and spec_a["accepted_tokens"] == 4
    assert [spec_a[f"accept_pos_{i}"] for i in (1, 2, 3)] == [2, 1, 1]
    assert traces()[0]["drafts"] == traces()[0]["accept_pos_1"] == 0
    with pytest.raises(ValueError, match="accepted more"):
        trace_counts(Trace(tokens=[1], target_forwards=2, proposed=[1], accepted=[2]), K)
    with pytest.raises(ValueError, match="more than k=3"):
        trace_counts(Trace(tokens=[1], target_forwards=2, proposed=[4], accepted=[0]), K)


def test_per_prompt_and_summary_arithmetic(tmp_path):
    meta = {"variant": "v", "backend": "offline"}
    summary = write_results(traces(), K, tmp_path / "per_prompt.csv", tmp_path / "summary.json", meta,
                            {"eagle3_draft": {"lossless": True}})
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    df = pd.read_csv(tmp_path / "per_prompt.csv").set_index(["method", "prompt_id"])
    assert df.loc[("eagle3_draft", "a"), "acceptance_length"] == pytest.approx(10 / 6)
    assert df.loc[("eagle3_draft", "a"), "tokens_per_s"] == pytest.approx(20.0)
    assert df.loc[("eagle3_draft", "a"), "speedup"] == pytest.approx(2.0)  # 20 vs 10 tokens/s
    assert df.loc[("eagle3_draft", "b"), "acceptance_length"] == pytest.approx(2.0)
    assert df.loc[("eagle3_draft", "b"), "speedup"] == pytest.approx(2.0)  # 4 vs 2 tokens/s
    assert df.loc[("target_greedy", "b"), "acceptance_length"] == 1.0

    spec = summary["methods"]["eagle3_draft"]
    assert spec["acceptance_length"] == pytest.approx(14 / 8)  # ratio of sums, not mean of per-prompt ratios
    # 5 drafts: position 1 accepted in 3 (a: 2, b: 1), position 2 in 2 (a: 1, b: 1), position 3 in 1 (a)
    assert spec["per_position_acceptance"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    # 6 draft tokens accepted over 5 drafts, plus each round's bonus token: 1 + the per-position sum
    assert spec["tokens_per_drafted_round"] == pytest.approx(1 + 6 / 5) == 1 + sum(spec["per_position_acceptance"])
    assert spec["tokens_per_s"] == pytest.approx(14 / 1.5)
    assert spec["speedup"] == pytest.approx((14 / 1.5) / (14 / 3.0))
    greedy = summary["methods"]["target_greedy"]
    assert greedy["per_position_acceptance"] == [None, None, None] and greedy["speedup"] == pytest.approx(1.0)
    assert greedy["tokens_per_drafted_round"] is None
    assert spec["lossless"] is True and "lossless" not in greedy and summary["num_speculative_tokens"] == K
    # after the first token: 12 tokens in (0.5 - 0.1) + (1.0 - 0.5) s vs 12 in (1.0 - 0.1) + (2.0 - 0.5) s
    assert spec["decode_tokens_per_s"] == pytest.approx(12 / 0.9)
    assert spec["decode_speedup"] == pytest.approx((12 / 0.9) / (12 / 2.4))
    assert greedy["decode_speedup"] == pytest.approx(1.0)
    # one batch size (the offline backend decodes one prompt at a time): the schema of a vllm sweep's summary
    assert summary["batch_sizes"] == [1] and set(df["batch_size"]) == {1}
    # per request: the first token's time, then (0.5 - 0.1) s over a's 9 later tokens and (1.0 - 0.5) s over b's 3
    tpot = sorted([0.4 / 9, 0.5 / 3])
    latency = {"ttft_p50": pytest.approx(0.3), "tpot_p50": pytest.approx(sum(tpot) / 2),
               "tpot_p90": pytest.approx(tpot[0] + 0.9 * (tpot[1] - tpot[0]))}
    assert spec["per_batch_size"] == {"1": {"tokens_per_s": spec["tokens_per_s"], "speedup": spec["speedup"],
                                            "acceptance_length": spec["acceptance_length"], "prompts": 2,
                                            "new_tokens": 14, "seconds": 1.5, **latency}}
    assert spec["pays_up_to"] == 1 and "pays_up_to" not in greedy and greedy["per_batch_size"]["1"]["speedup"] == 1.0


def test_rows_without_first_token_times_have_no_decode_speedup(tmp_path):
    """A backend that does not time the first token (vLLM's server runs) leaves decode_speedup NaN, not a guess."""
    rows = [{key: value for key, value in r.items() if key != "first_token_seconds"} for r in traces()]
    summary = write_results(rows, K, tmp_path / "per_prompt.csv", tmp_path / "summary.json", {"variant": "v"})
    assert all(math.isnan(m["decode_speedup"]) for m in summary["methods"].values())
    assert summary["methods"]["eagle3_draft"]["speedup"] == pytest.approx((14 / 1.5) / (14 / 3.0))


def test_the_stopping_rule_keeps_the_stop_token_and_caps_the_length():
    assert cut_output([5, 6, 2, 7, 2], 10, {2}) == [5, 6, 2]
    assert cut_output([5, 6, 7, 8], 3, {2}) == [5, 6, 7]
    assert cut_output([5, 6, 7, 2], 3, {2}) == [5, 6, 7]  # the cap comes first
    assert cut_output([], 3, {2}) == []


def repeated(rows: list[dict], runs: dict[tuple[str, str], list[float]]) -> list[dict]:
    """`rows` with each (method, prompt)'s run times as `repeat_seconds`."""
    return [{**r, "repeat_seconds": runs[(r["method"], r["prompt_id"])]} for r in rows]


def test_repeated_runs_give_median_times_a_spread_and_a_speedup_range(tmp_path):
    """Three runs per prompt and method: seconds is the median, time_spread (max - min) / median, and the speedup of
    each run alone (run r of every prompt against the baseline's run r) bounds the summary's speedup_range."""
    runs = {("target_greedy", "a"): [1.0, 1.2, 0.9], ("eagle3_draft", "a"): [0.5, 0.4, 0.6],
            ("target_greedy", "b"): [2.0, 2.0, 3.0], ("eagle3_draft", "b"): [1.0, 1.5, 1.0]}
    summary = write_results(repeated(traces(), runs), K, tmp_path / "per_prompt.csv", tmp_path / "summary.json",
                            {"variant": "v"})
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    df = pd.read_csv(tmp_path / "per_prompt.csv").set_index(["method", "prompt_id"])
    assert df.loc[("target_greedy", "a"), "seconds"] == pytest.approx(1.0)  # the median, not the first run
    assert df.loc[("target_greedy", "a"), "time_spread"] == pytest.approx((1.2 - 0.9) / 1.0)
    assert df.loc[("eagle3_draft", "b"), "time_spread"] == pytest.approx(0.5)
    assert (df["repeats"] == 3).all()
    assert [float(x) for x in df.loc[("eagle3_draft", "a"), "repeat_seconds"].split()] == [0.5, 0.4, 0.6]
    spec = summary["methods"]["eagle3_draft"]
    assert spec["repeats"] == 3
    assert spec["speedup"] == pytest.approx((14 / 1.5) / (14 / 3.0))  # medians: 0.5 + 1.0 against 1.0 + 2.0
    by_repeat = [(14 / (0.5 + 1.0)) / (14 / (1.0 + 2.0)), (14 / (0.4 + 1.5)) / (14 / (1.2 + 2.0)),
                 (14 / (0.6 + 1.0)) / (14 / (0.9 + 3.0))]
    assert spec["speedup_by_repeat"] == pytest.approx(by_repeat)
    assert spec["speedup_range"] == pytest.approx([min(by_repeat), max(by_repeat)])
    assert spec["time_spread"] == pytest.approx(statistics.median([0.4, 0.5]))  # a: 0.2 / 0.5, b: 0.5 / 1.0
    assert spec["time_spread_max"] == pytest.approx(0.5)
    greedy = summary["methods"]["target_greedy"]
    assert greedy["speedup_by_repeat"] == pytest.approx([1.0, 1.0, 1.0]) and greedy["speedup_range"] == [1.0, 1.0]
    assert spec["per_category"]["all"]["speedup_range"] == pytest.approx(spec["speedup_range"])


def test_a_single_timed_run_leaves_the_spread_unknown(tmp_path):
    """Rows with one time each (the vLLM backend) have no spread and no speedup range: null, not a false zero."""
    summary = write_results(traces(), K, tmp_path / "per_prompt.csv", tmp_path / "summary.json", {"variant": "v"})
    spec = summary["methods"]["eagle3_draft"]
    assert spec["repeats"] == 1 and spec["speedup_range"] is None and spec["speedup_by_repeat"] is None
    assert spec["time_spread"] is None
    df = pd.read_csv(tmp_path / "per_prompt.csv")
    assert (df["repeats"] == 1).all() and df["time_spread"].isna().all()


def test_interleaved_timing_rotates_the_order_and_flags_a_run_that_decodes_otherwise():
    """time_interleaved runs every method once per run, in an order rotated per prompt and run; a method whose later
    run emits other tokens is flagged, its first run's counts kept."""
    from draftsmith.benchmark.interleaved import run_order, time_interleaved

    calls = []

    def decoder(method, flaky=False):
        def decode(ids):
            calls.append(method)
            n = sum(c == method for c in calls)
            tokens = [1, 2, 3] if not (flaky and n == 2) else [1, 2, 4]
            return Trace(tokens=tokens, target_forwards=3, seconds=0.1 * n, first_token_seconds=0.01 * n)
        return decode

    methods = ["target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft"]
    decoders = {m: decoder(m, flaky=m == "untrained_draft") for m in methods}
    timed = time_interleaved(decoders, [0], repeats=3, shift=1, k=K)
    assert calls == run_order(methods, 1) + run_order(methods, 2) + run_order(methods, 3)
    assert calls[:4] == ["prompt_lookup", "untrained_draft", "eagle3_draft", "target_greedy"]
    assert [calls[i * 4] for i in range(3)] == ["prompt_lookup", "untrained_draft", "eagle3_draft"]  # first changes
    assert list(timed) == methods
    assert timed["target_greedy"].positions == [3, 2, 1] and timed["prompt_lookup"].positions == [0, 3, 2]
    assert timed["eagle3_draft"].seconds == pytest.approx([0.1, 0.2, 0.3])
    row = timed["eagle3_draft"].row(K)
    assert row["repeat_seconds"] == pytest.approx([0.1, 0.2, 0.3]) and row["first_token_seconds"] == pytest.approx(0.02)
    assert row["run_order"] == "2 1 0"
    assert [t.repeatable for t in timed.values()] == [True, True, False, True]
    assert timed["untrained_draft"].trace.tokens == [1, 2, 3]  # the first run's output stands
