"""Throughput under load: the batch sizes a benchmark measures (`benchmark.batch_sizes`) and where the draft stops paying.

`benchmark.batch_sizes` lists the sizes, ascending; null means one size, the one the backend's own key gives:
`concurrency` (vllm: requests in flight) or `batch_size` (offline). Given, it replaces both, which must then be left
at 1 (draftsmith.config.workflow says so, naming file and key). The vllm backend sweeps its requests in flight over
the sizes, every method at every size against one server per method; the offline backend decodes the prompts one at
a time at size 1 and B at a time at a size B above it (draftsmith.decoding.engine), every method at every size.

What a summary holds per size (`per_batch_size`, `pays_up_to`) is draftsmith.benchmark.results'.
This module imports nothing heavy: the workflow reads it while it builds the DAG, and config checks it.
"""

from __future__ import annotations


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
