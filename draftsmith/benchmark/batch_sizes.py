"""Throughput under load: the batch sizes a benchmark measures (`benchmark.batch_sizes`) and where the draft stops paying.

`benchmark.batch_sizes` lists the sizes, ascending; null means one size, the one the backend's own key gives:
`concurrency` (vllm: requests in flight) or `batch_size` (offline). Given, it replaces both, which must then be left
at 1 (draftsmith.config.workflow says so, naming file and key). The vllm backend sweeps its requests in flight over
the sizes, every method at every size against one server per method; the offline backend decodes the prompts one at
a time at size 1 and B at a time at a size B above it (draftsmith.benchmark.batch_spec), every method at every size.

Per method, a summary's `per_batch_size` holds {size: {tokens_per_s, speedup, acceptance_length, ...}} (JSON keys are
strings), the speedup against target-only greedy at the same size; `pays_up_to` is the largest size up to which the
method beats target-only greedy at every measured size (null where it does not beat it at the smallest).
This module imports nothing heavy: the workflow reads it while it builds the DAG.
"""

from __future__ import annotations

import math

def batch_sizes(bench: dict, backend: str | None = None) -> list[int]:
    """The sizes a benchmark section measures: batch_sizes, else the one size of `concurrency` (vllm) or `batch_size`
    (offline); `backend` defaults to the section's own."""
    sizes = bench.get("batch_sizes")
    if sizes:
        return [int(s) for s in sizes]
    backend = backend or bench.get("backend", "offline")
    return [max(1, int(bench.get("concurrency" if backend == "vllm" else "batch_size") or 1))]


def batch_size_problems(bench: dict) -> list[tuple[str, str]]:
    """(key, problem) of a benchmark section's batch sizes that the schema cannot say: not ascending, and concurrency
    or batch_size set beside batch_sizes."""
    sizes = bench.get("batch_sizes")
    if not isinstance(sizes, list) or not sizes or not all(isinstance(s, int) and not isinstance(s, bool) for s in sizes):
        return []  # absent, null, or a type the schema reports
    problems = []
    if len(set(sizes)) == len(sizes) and sizes != sorted(sizes):  # repeats: the schema's uniqueItems says so
        problems.append(("batch_sizes", f"{sizes} must be ascending, e.g. {sorted(sizes)}"))
    for key in ("concurrency", "batch_size"):
        if bench.get(key) not in (None, 1):
            problems.append((key, f"{bench[key]} beside benchmark.batch_sizes, which replaces it: leave {key} out "
                                  f"(or 1) and list the size in batch_sizes"))
    return problems


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
    keys = ("tokens_per_s", "speedup", "acceptance_length", "prompts", "new_tokens", "seconds")
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
