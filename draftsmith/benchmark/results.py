"""Benchmark result tables shared by the offline and vLLM backends.

`per_prompt.csv` has one row per (prompt, method, batch size); `summary.json` aggregates per method, and within
each method per prompt category (MT-Bench's eight, the synthetic task families, or "all"), with `per_batch_size`
and `pays_up_to` per method (both backends measure every size of `benchmark.batch_sizes`: draftsmith.config.batch_sizes,
the offline one with batched decoding above size 1). Per method, `per_batch_size` holds {size: {tokens_per_s, speedup,
acceptance_length, ...}} (JSON keys are strings), the speedup against target-only greedy at the same size; `pays_up_to`
is the largest size up to which the method beats target-only greedy at every measured size (null where it does not
beat it at the smallest).
Acceptance length is tokens generated per target forward pass, the bonus token included (each prompt's
forward counts, and yields one token); `tokens_per_drafted_round` is 1 + accepted draft tokens per draft,
the tokens a round with a proposal yields (the acceptance length the EAGLE papers report). Besides the
end-to-end speed, the offline backend times the first token (the prompt's forward, which every method pays
once): `decode_speedup` compares the tokens after it, per second after it (the time-per-output-token view);
backends without that time leave it NaN.

Timing: the offline backend times every method `benchmark.repeats` times per prompt, the methods interleaved
(draftsmith.benchmark.offline). A row's `seconds` is the median of its runs (`repeat_seconds`, in run order),
`time_spread` their range over the median ((max - min) / median). Per method, `speedup_by_repeat` is the speedup of
run r alone (every prompt's r-th run against the baseline's r-th run of the same prompt, timed next to it), and
`speedup_range` the lowest and highest of those and of `speedup`: the report ranks methods only where these
ranges are apart. One timed run (the vLLM backend) leaves the spread and the range unknown (null).
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pandas as pd

from draftsmith.io import atomic_path, write_json

BASELINE = "target_greedy"
# every method a benchmark may report, in the order tables and figures show them
METHODS = [BASELINE, "prompt_lookup", "untrained_draft", "eagle3_draft", "hybrid"]
COLUMNS = [
    "variant", "backend", "method", "prompt_id", "category", "batch_size", "prompt_tokens", "new_tokens", "target_forwards",
    "drafts", "draft_tokens", "accepted_tokens", "acceptance_length", "seconds", "first_token_seconds", "tokens_per_s",
    "speedup", "repeats", "time_spread", "repeat_seconds", "run_order", "ttft_seconds", "tpot_seconds",
]


def accept_columns(k: int) -> list[str]:
    return [f"accept_pos_{i}" for i in range(1, k + 1)]


def trace_counts(trace, k: int) -> dict:
    """A decoded request's row fields (a draftsmith.decoding.trace.Trace; rounds without a proposal are not drafts)."""
    if any(p > k for p in trace.proposed):
        raise ValueError(f"a round proposed more than k={k} draft tokens: {max(trace.proposed)}")
    if any(a > p for a, p in zip(trace.accepted, trace.proposed)):
        raise ValueError("a round accepted more draft tokens than it proposed")
    row = {
        "new_tokens": len(trace.tokens),
        "target_forwards": trace.target_forwards,
        "drafts": sum(1 for p in trace.proposed if p > 0),
        "draft_tokens": sum(trace.proposed),
        "accepted_tokens": sum(trace.accepted),
        "seconds": trace.seconds,
        "first_token_seconds": trace.first_token_seconds,
        **trace_latency(trace),
    }
    for i in range(1, k + 1):
        row[f"accept_pos_{i}"] = sum(1 for a in trace.accepted if a >= i)
    return row


def trace_latency(trace) -> dict:
    """A request's time to its first token and time per output token after it (alone: its own times)."""
    if trace.ttft_seconds is not None:
        return {"ttft_seconds": trace.ttft_seconds, "tpot_seconds": trace.tpot_seconds}
    first = trace.first_token_seconds
    after = (trace.seconds - first) / (len(trace.tokens) - 1) if first is not None and len(trace.tokens) > 1 else None
    return {"ttft_seconds": first, "tpot_seconds": after}


def format_times(times) -> str:
    """Run times as one CSV cell: seconds separated by spaces, in run order."""
    return " ".join(repr(float(t)) for t in times)


def parse_times(cell) -> list[float]:
    """A `repeat_seconds` cell (or a list of seconds) as floats; empty for a missing value."""
    if isinstance(cell, (list, tuple)):
        return [float(t) for t in cell]
    if cell is None or (isinstance(cell, float) and math.isnan(cell)):
        return []
    return [float(t) for t in str(cell).split()]


def relative_spread(times: list[float]) -> float:
    """(max - min) / median of one prompt's run times; NaN for fewer than two runs."""
    if len(times) < 2:
        return math.nan
    median = statistics.median(times)
    return (max(times) - min(times)) / median if median > 0 else math.nan


def finish_rows(rows: list[dict], k: int) -> pd.DataFrame:
    """Fill derived columns (acceptance length, tokens/s, speedup over target-only greedy per prompt, and the
    timing columns: `seconds` is the median of `repeat_seconds` where a row has them, else its single run)."""
    df = pd.DataFrame(rows)
    if "batch_size" not in df:  # rows of one size-1 run
        df["batch_size"] = 1
    df["batch_size"] = df["batch_size"].astype(int)
    for col in accept_columns(k):
        if col not in df:
            df[col] = 0
    if "first_token_seconds" not in df:
        df["first_token_seconds"] = math.nan
    df["first_token_seconds"] = df["first_token_seconds"].astype(float)
    for col in ("ttft_seconds", "tpot_seconds"):  # per request; a backend without them leaves them NaN
        df[col] = df[col].astype(float) if col in df else math.nan
    times = df["repeat_seconds"].map(parse_times) if "repeat_seconds" in df else pd.Series([[]] * len(df), index=df.index)
    times = pd.Series([t or [float(s)] for t, s in zip(times, df["seconds"])], index=df.index, dtype=object)
    df["seconds"] = times.map(statistics.median).astype(float)
    df["repeats"] = times.map(len).astype(int)
    df["time_spread"] = times.map(relative_spread).astype(float)
    df["repeat_seconds"] = times.map(format_times)
    if "run_order" not in df:
        df["run_order"] = ""
    df["run_order"] = df["run_order"].fillna("").astype(str)
    df["acceptance_length"] = df["new_tokens"] / df["target_forwards"]
    df["tokens_per_s"] = df["new_tokens"] / df["seconds"]
    base = df[df["method"] == BASELINE].set_index(["batch_size", "prompt_id"])["tokens_per_s"]
    keys = pd.MultiIndex.from_arrays([df["batch_size"], df["prompt_id"]])
    df["speedup"] = df["tokens_per_s"].to_numpy() / base.reindex(keys).to_numpy()
    return df[COLUMNS + accept_columns(k)]


def first_size_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of each variant's smallest batch size, the size a summary's top-level figures are for (a per_prompt.csv
    of a sweep holds every size's rows; one without the column, a single size)."""
    if "batch_size" not in df or df.empty:
        return df
    smallest = df.groupby("variant")["batch_size"].transform("min") if "variant" in df else df["batch_size"].min()
    return df[df["batch_size"] == smallest]


def _repeat_matrix(g: pd.DataFrame) -> np.ndarray | None:
    """[prompt, run] seconds of a group's rows; None unless every row has the same number (>= 2) of runs."""
    times = [parse_times(c) for c in g["repeat_seconds"]] if "repeat_seconds" in g else []
    if not times or len({len(t) for t in times}) != 1 or len(times[0]) < 2:
        return None
    return np.array(times, dtype=float)


def speedup_by_repeat(g: pd.DataFrame, base: pd.DataFrame) -> list[float] | None:
    """The speedup of each run alone: the group's tokens over its prompts' r-th run times, against the baseline's
    tokens over the same prompts' r-th run times (run r of every method on a prompt is timed in the same round)."""
    mine, theirs = _repeat_matrix(g), _repeat_matrix(base)
    if mine is None or theirs is None or mine.shape[1] != theirs.shape[1]:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        tps = g["new_tokens"].sum() / mine.sum(axis=0)
        base_tps = base["new_tokens"].sum() / theirs.sum(axis=0)
        return [float(x) for x in tps / base_tps]


def _timing(g: pd.DataFrame, base: pd.DataFrame, speedup: float) -> dict:
    """Repeats, the spread of the run times (median and largest over the group's prompts) and the speedup's range."""
    by_repeat = speedup_by_repeat(g, base)
    spreads = g["time_spread"].dropna() if "time_spread" in g else pd.Series(dtype=float)
    values = [v for v in [*(by_repeat or []), speedup] if not math.isnan(v)]
    return {
        "repeats": int(g["repeats"].min()) if "repeats" in g and len(g) else 1,
        "time_spread": float(spreads.median()) if len(spreads) else None,
        "time_spread_max": float(spreads.max()) if len(spreads) else None,
        "speedup_by_repeat": by_repeat,
        "speedup_range": [min(values), max(values)] if by_repeat is not None and values else None,
    }


def _aggregate(g: pd.DataFrame, base: pd.DataFrame, k: int) -> dict:
    """Totals over a group of rows of one method; `base` is the target_greedy rows of the same prompts."""
    drafts = g["drafts"].sum()
    new_tokens, seconds = int(g["new_tokens"].sum()), float(g["seconds"].sum())
    base_tps = base["new_tokens"].sum() / base["seconds"].sum() if len(base) else math.nan
    decode_tps, base_decode_tps = _decode_tokens_per_s(g), _decode_tokens_per_s(base)
    speedup = (new_tokens / seconds) / base_tps if seconds and base_tps else math.nan
    return {
        "prompts": int(len(g)),
        "acceptance_length": float(g["new_tokens"].sum() / g["target_forwards"].sum()),
        "per_position_acceptance": [float(g[c].sum() / drafts) if drafts else None for c in accept_columns(k)],
        "tokens_per_drafted_round": float(1 + g["accepted_tokens"].sum() / drafts) if drafts else None,
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds else math.nan,
        "speedup": speedup,
        "decode_tokens_per_s": decode_tps,
        "decode_speedup": decode_tps / base_decode_tps if base_decode_tps else math.nan,
        **_timing(g, base, speedup),
        **_latency(g),
    }


def _latency(g: pd.DataFrame) -> dict:
    """The requests' time to first token (median) and time per output token after it (median and 90th percentile),
    in seconds; None where the rows have none."""
    ttft, tpot = g["ttft_seconds"].dropna(), g["tpot_seconds"].dropna()
    return {"ttft_p50": float(ttft.median()) if len(ttft) else None,
            "tpot_p50": float(tpot.median()) if len(tpot) else None,
            "tpot_p90": float(tpot.quantile(0.9)) if len(tpot) else None}


def _decode_tokens_per_s(g: pd.DataFrame) -> float:
    """Tokens after each prompt's first one, per second after it; NaN without first-token times."""
    first = g["first_token_seconds"]
    if not len(g) or first.isna().any():
        return math.nan
    seconds = float(g["seconds"].sum() - first.sum())
    return float(g["new_tokens"].sum() - len(g)) / seconds if seconds > 0 else math.nan


def summarise(df: pd.DataFrame, k: int) -> dict:
    methods = {}
    base = df[df["method"] == BASELINE]
    for method, g in df.groupby("method", sort=False):
        methods[method] = _aggregate(g, base, k)
        methods[method]["per_category"] = {
            category: {key: value for key, value in _aggregate(c, base[base["category"] == category], k).items()
                       if key in ("prompts", "acceptance_length", "new_tokens", "speedup", "decode_speedup", "speedup_range")}
            for category, c in g.groupby("category", sort=True)}
    return methods


def _known(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def pays_up_to(per_batch_size: dict) -> int | None:
    """The largest size up to which the speedup is above 1 at every measured size; None where it is not at the
    smallest (or unknown there)."""
    best = None
    for size in sorted(per_batch_size, key=int):
        speedup = per_batch_size[size].get("speedup")
        if not _known(speedup) or speedup <= 1:
            break
        best = int(size)
    return best


def per_batch_size_entry(method_entry: dict) -> dict:
    """The figures of one method at one size, from that size's summary entry."""
    keys = ("tokens_per_s", "speedup", "acceptance_length", "prompts", "new_tokens", "seconds", "ttft_p50", "tpot_p50",
            "tpot_p90")
    return {key: method_entry.get(key) for key in keys}


def add_per_batch_size(by_size: dict[int, dict[str, dict]], baseline: str,
                       extras: dict[int, dict[str, dict]] | None = None) -> dict[str, dict]:
    """The summary's methods: those of the smallest size, each with `per_batch_size` (every size's figures, with
    `extras[size][method]` added) and, for each method but the baseline, `pays_up_to`."""
    sizes = sorted(by_size)
    methods = by_size[sizes[0]]
    for method, entry in methods.items():
        entry["per_batch_size"] = {str(s): {**per_batch_size_entry(by_size[s][method]),
                                            **((extras or {}).get(s, {}).get(method) or {})}
                                   for s in sizes if method in by_size[s]}
        if method != baseline:
            entry["pays_up_to"] = pays_up_to(entry["per_batch_size"])
    return methods


def ideal_speedup(acceptance_length: float, k: int, cost_ratio: float) -> float:
    """tau / (1 + k * c): the speedup a round would give if its only costs were k draft steps and one target step."""
    return acceptance_length / (1 + k * cost_ratio)


def verify_ratio(step_costs: dict | None) -> float | None:
    """v = the verification step over k + 1 tokens / a one-token step, from draftsmith.benchmark.step_costs' times
    (None without them: a summary of another backend, or from before they were timed)."""
    if not step_costs or step_costs.get("verify_step_ms") is None or not step_costs.get("target_step_ms"):
        return None
    return step_costs["verify_step_ms"] / step_costs["target_step_ms"]


def round_model_speedup(acceptance_length: float, k: int, step_costs: dict) -> float:
    """tau / (v + k * c), v = verify_ratio: the speedup of a round costing its k draft steps and its measured
    verification over k + 1 tokens; below ideal_speedup by what the verification's width costs. An estimate from
    steps timed one by one (each with a host sync), not a bound."""
    return acceptance_length / (verify_ratio(step_costs) + k * step_costs["cost_ratio"])


def write_results(rows: list[dict], k: int, out_per_prompt, out_summary, meta: dict,
                  method_extras: dict[str, dict] | None = None,
                  size_extras: dict[int, dict[str, dict]] | None = None) -> dict:
    """Write both tables atomically; `meta` (variant, backend, device, settings, versions) goes into the
    summary, and `method_extras[method]` (e.g. lossless, step_costs) into that method's entry, with
    `ideal_speedup` and `round_model_speedup` derived from a method's step_costs and acceptance length. Rows of several batch sizes (their
    `batch_size`): the methods' figures are the smallest size's, every size's in `per_batch_size`, with
    `size_extras[size][method]` added there."""
    df = finish_rows(rows, k)
    with atomic_path(out_per_prompt, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)
    sizes = sorted(int(s) for s in df["batch_size"].unique())
    by_size = {size: summarise(df[df["batch_size"] == size], k) for size in sizes}
    methods = by_size[sizes[0]]
    for method, extras in (method_extras or {}).items():
        methods[method].update(extras)
        if "step_costs" in extras:  # draftsmith.benchmark.step_costs
            methods[method]["ideal_speedup"] = ideal_speedup(methods[method]["acceptance_length"], k,
                                                             extras["step_costs"]["cost_ratio"])
            methods[method]["round_model_speedup"] = round_model_speedup(methods[method]["acceptance_length"], k,
                                                                         extras["step_costs"])
    add_per_batch_size(by_size, BASELINE, size_extras)  # one size too: the schema of a sweep's summary
    summary = {"batch_sizes": sizes, **meta, "num_speculative_tokens": k, "methods": methods}
    write_json(out_summary, summary)
    return summary
