"""Interleaved timing: every method `benchmark.repeats` times on one prompt (or one batch), the methods alternating
within each run in an order rotated from run to run and from prompt to prompt, so that no method always goes first
and drifting clocks, thermals or other jobs on the machine hit them alike. Each method keeps its first run's trace
(its counts), every run's times and positions, and whether every run emitted the same tokens with the same counts
(greedy decoding is deterministic: a run that does not is reported, not hidden)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from draftsmith.benchmark.results import trace_counts, trace_latency


def run_order(methods: list[str], shift: int) -> list[str]:
    """The methods rotated left by `shift`: run r of prompt i uses shift i + r."""
    shift %= len(methods)
    return methods[shift:] + methods[:shift]


@dataclass
class Timed:
    """One method's runs on one prompt: the first run's trace (its counts), every run's times and positions, and
    whether every run emitted the same tokens with the same counts."""

    trace: object
    seconds: list[float] = field(default_factory=list)
    first_token_seconds: list[float] = field(default_factory=list)
    latencies: list[dict] = field(default_factory=list)  # each run's ttft_seconds and tpot_seconds
    positions: list[int] = field(default_factory=list)
    repeatable: bool = True

    def add(self, trace, position: int, k: int) -> None:
        """One more run: its times and position, and whether it emitted what the first run did."""
        if trace.tokens != self.trace.tokens or _counts(trace, k) != _counts(self.trace, k):
            self.repeatable = False
        self.seconds.append(trace.seconds)
        self.first_token_seconds.append(trace.first_token_seconds)
        self.latencies.append(trace_latency(trace))
        self.positions.append(position)

    def row(self, k: int) -> dict:
        firsts = [t for t in self.first_token_seconds if t is not None]
        latency = {key: [run[key] for run in self.latencies if run[key] is not None] for key in self.latencies[0]}
        return {**trace_counts(self.trace, k), "repeat_seconds": list(self.seconds),
                "first_token_seconds": statistics.median(firsts) if firsts else None,
                **{key: statistics.median(values) if values else None for key, values in latency.items()},
                "run_order": " ".join(map(str, self.positions))}


TIMES = ("seconds", "first_token_seconds", "ttft_seconds", "tpot_seconds")


def _counts(trace, k: int) -> dict:
    """What a run decoded (tokens, forwards, drafts, accepted per position), without its times."""
    return {key: v for key, v in trace_counts(trace, k).items() if key not in TIMES}


def time_interleaved(decoders: dict, ids: list[int], repeats: int, shift: int, k: int) -> dict[str, Timed]:
    """Every method `repeats` times on one prompt, interleaved: run r runs each method once, in the order of
    `run_order(methods, shift + r)`."""
    methods = list(decoders)
    timed: dict[str, Timed] = {}
    for r in range(repeats):
        for position, method in enumerate(run_order(methods, shift + r)):
            trace = decoders[method](ids)
            timed.setdefault(method, Timed(trace)).add(trace, position, k)
    return {m: timed[m] for m in methods}


def time_batch_interleaved(decoders: dict, batch: list[list[int]], repeats: int, shift: int,
                           k: int) -> dict[str, list[Timed]]:
    """time_interleaved for batch decoders (each decodes the whole batch, one trace per row): per method, each row's
    runs; the rows of a run share its position."""
    methods = list(decoders)
    timed: dict[str, list[Timed]] = {}
    for r in range(repeats):
        for position, method in enumerate(run_order(methods, shift + r)):
            traces = decoders[method](batch)
            for row, trace in zip(timed.setdefault(method, [Timed(t) for t in traces]), traces):
                row.add(trace, position, k)
    return {m: timed[m] for m in methods}


def per_prompt(timed: list[Timed], prompt_ids: list[str], k: int) -> dict[str, Timed]:
    """The runs of several requests of one prompt (`prompt_ids`: each request's prompt) as that prompt's: the first
    request's trace and times (a request's share of the run's wall time), each run's latency the median of its
    requests', repeatable only where every request emitted the first's tokens and counts in every run."""
    by_prompt: dict[str, list[Timed]] = {}
    for pid, t in zip(prompt_ids, timed):
        by_prompt.setdefault(pid, []).append(t)
    merged = {}
    for pid, requests in by_prompt.items():
        first = requests[0]
        same = all(r.repeatable and r.trace.tokens == first.trace.tokens
                   and _counts(r.trace, k) == _counts(first.trace, k) for r in requests)
        latencies = [{key: _median([r.latencies[run][key] for r in requests]) for key in first.latencies[run]}
                     for run in range(len(first.latencies))]
        merged[pid] = Timed(first.trace, list(first.seconds),
                            [_median([r.first_token_seconds[run] for r in requests])
                             for run in range(len(first.first_token_seconds))],
                            latencies, list(first.positions), same)
    return merged


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
