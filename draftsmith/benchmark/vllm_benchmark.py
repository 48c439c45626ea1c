"""The `vllm` benchmark backend: the trained draft served by `vllm serve` as an EAGLE-3 speculative model.

Two servers on the same prompts: the target alone (`target_greedy`), then the target with the draft (`eagle3_draft`,
`--speculative-config` with method eagle3 and k from config). Each is started once and runs the prompts at every
batch size of `benchmark.batch_sizes` in turn (draftsmith.config.batch_sizes; without it, the one size
`concurrency`): that many requests in flight, the next sent as one finishes. Throughput comes from the responses
(completion tokens over request time at size 1, over the size's wall time above it); acceptance from vLLM's Prometheus
spec-decode counters, read before and after each size. At size 1 they are also read before and after each request,
so every prompt gets its own acceptance, and the requests' own deltas must add up to the size's; at a larger size the
engine's counters cannot be split by request (vLLM returns none per request), so only the size's totals are known and
go into the summary. The sizes' deltas must add up to the delta over the whole run (nothing else used the server).
The server is always stopped (its whole process group), also when something fails. Results are the tables of
draftsmith.benchmark.results, as for the offline backend, with `per_batch_size` per method; the per-prompt rows carry
their batch size. The server process and its command are draftsmith.benchmark.vllm_server; the counters,
draftsmith.benchmark.prometheus.
"""

from __future__ import annotations

import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from draftsmith.benchmark.prometheus import counter_delta
from draftsmith.benchmark.results import (
    BASELINE,
    accept_columns,
    add_per_batch_size,
    finish_rows,
    summarise,
)
from draftsmith.benchmark.vllm_server import (
    ServerError,
    VllmServer,
    check_cpu_test_worker,
    free_port,
    serve_command,
    speculative_config,
)
from draftsmith.config.batch_sizes import batch_sizes
from draftsmith.devices import gpu_name
from draftsmith.io import atomic_path, read_json, sha256_bytes, write_json
from draftsmith.provenance import device_description, package_versions
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vllm_stack.probes import CPU_TEST_WORKER

log = logging.getLogger(__name__)

METHOD = "eagle3_draft"
BASELINE_FILE = "target_only_run.json"
OUTPUTS_FILE = "vllm_outputs.json"  # beside the summary: {method: {prompt_id: generated token ids}}, smallest size
OUTPUTS_BY_SIZE_FILE = "vllm_outputs_by_batch_size.json"  # with several sizes: {size: {method: {prompt_id: ids}}}
# the one definition used in every summary (the offline backend's too); vLLM's own "mean acceptance
# length", 1 + accepted / drafts, leaves out the prefill's token and is not reported
ACCEPTANCE_LENGTH = "generated tokens per target forward pass (the prefill and each verification), bonus token included"


# ----------------------------------------------------------------------------- the runs


def sum_counters(deltas: list[dict]) -> dict | None:
    """Counter deltas added up, key by key (per position for accepted_per_pos); None for no deltas."""
    if not deltas:
        return None
    return {key: [sum(d[key][i] for d in deltas) for i in range(len(deltas[0][key]))]
            if isinstance(deltas[0][key], list) else sum(d[key] for d in deltas) for key in deltas[0]}


def run_method(server: VllmServer, prompts: list[dict], cfg: dict, method: str, variant: str,
               size: int = 1) -> tuple[list[dict], dict]:
    """All prompts on one server with `size` requests in flight; returns the rows and the size's totals (wall seconds,
    each prompt's generated token ids as `outputs`, and for the draft the counter delta over the size, `counters`,
    and at size 1 the sum of each request's own delta, `per_request_counters`)."""
    from tqdm import tqdm

    k, max_tokens, seed = cfg["num_speculative_tokens"], cfg["max_new_tokens"], cfg["seed"]
    speculative = method == METHOD
    before_all = server.metrics(k) if speculative else None
    rows, outputs, deltas = [], {}, []
    start = time.perf_counter()

    def row(prompt, result, delta):
        result = dict(result)
        outputs[prompt["prompt_id"]] = result.pop("output_token_ids", None)
        base = {"variant": variant, "backend": "vllm", "method": method, "prompt_id": prompt["prompt_id"],
                "category": prompt["category"], "batch_size": size, **result}
        if not speculative:
            return {**base, "target_forwards": result["new_tokens"], "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        if delta is None:  # concurrent requests: per-request counters are not separable
            return {**base, "target_forwards": math.nan, "drafts": math.nan, "draft_tokens": math.nan,
                    "accepted_tokens": math.nan, **{c: math.nan for c in accept_columns(k)}}
        return {**base, "target_forwards": 1 + delta["drafts"],  # the prefill, then one verification per draft
                "drafts": delta["drafts"], "draft_tokens": delta["draft_tokens"], "accepted_tokens": delta["accepted"],
                **dict(zip(accept_columns(k), delta["accepted_per_pos"]))}

    with tqdm(total=len(prompts), desc=f"vllm {method} at {size} in flight", unit="prompt") as bar:
        if size == 1:
            for prompt in prompts:
                before = server.metrics(k) if speculative else None
                result = server.chat(prompt["messages"], max_tokens, seed)
                delta = counter_delta(server.metrics(k), before) if speculative else None
                if delta is not None:
                    deltas.append(delta)
                rows.append(row(prompt, result, delta))
                bar.update()
        else:
            with ThreadPoolExecutor(size) as pool:
                futures = [pool.submit(server.chat, p["messages"], max_tokens, seed) for p in prompts]
                for prompt, future in zip(prompts, futures):
                    rows.append(row(prompt, future.result(), None))
                    bar.update()
    totals = {"wall_seconds": time.perf_counter() - start, "outputs": outputs}
    if speculative:
        totals["counters"] = counter_delta(server.metrics(k), before_all)
        totals["per_request_counters"] = sum_counters(deltas)
    return rows, totals


def run_sizes(server: VllmServer, prompts: list[dict], cfg: dict, method: str, variant: str,
              sizes: list[int]) -> tuple[list[dict], dict]:
    """Every size in turn on one server, after one warm-up request; returns the rows and the run: {"sizes": {size:
    totals}, "counters": the delta over all sizes (the draft's; None for the target alone)}."""
    k, max_tokens, seed = cfg["num_speculative_tokens"], cfg["max_new_tokens"], cfg["seed"]
    server.chat(prompts[0]["messages"], min(8, max_tokens), seed)  # warm-up
    speculative = method == METHOD
    before = server.metrics(k) if speculative else None
    rows, run = [], {"sizes": {}, "counters": None}
    for size in sizes:
        if size > len(prompts):
            log.warning("batch size %d is above the %d benchmark prompts: at most %d requests are in flight", size,
                        len(prompts), len(prompts))
        size_rows, run["sizes"][size] = run_method(server, prompts, cfg, method, variant, size)
        rows += size_rows
    if speculative:
        run["counters"] = counter_delta(server.metrics(k), before)
    return rows, run


def device_summary(cfg: dict) -> str:
    name = gpu_name()
    if name is None:  # vLLM's CPU platform
        return f"{device_description(SimpleNamespace(type='cpu'))} (vllm serve)"
    return f"cuda: {name} x{cfg['tensor_parallel_size']} (vllm serve)"


def summarise_runs(rows: list[dict], totals: dict, k: int, concurrency: int) -> tuple:
    """The per-prompt table and per-method summary; with concurrency > 1, throughput and acceptance from totals."""
    import numpy as np

    df = finish_rows(rows, k)
    with np.errstate(divide="ignore", invalid="ignore"):  # concurrent runs: per-row acceptance is unknown (NaN)
        methods = summarise(df, k)
    for method, run in totals.items():
        entry = methods[method]
        entry["wall_seconds"] = run["wall_seconds"]
        counters = run.get("counters")
        if counters is not None:
            entry["counters"] = counters
        if concurrency > 1:
            entry["seconds"] = run["wall_seconds"]
            entry["tokens_per_s"] = entry["new_tokens"] / run["wall_seconds"]
            if counters is not None:
                entry["acceptance_length"] = entry["new_tokens"] / (entry["prompts"] + counters["drafts"])
                entry["per_position_acceptance"] = [a / counters["drafts"] if counters["drafts"] else None
                                                    for a in counters["accepted_per_pos"]]
                entry["tokens_per_drafted_round"] = (1 + counters["accepted"] / counters["drafts"]
                                                     if counters["drafts"] else None)
    if concurrency > 1 and BASELINE in methods:
        for entry in methods.values():
            entry["speedup"] = entry["tokens_per_s"] / methods[BASELINE]["tokens_per_s"]
    base_outputs = totals.get(BASELINE, {}).get("outputs") or {}
    for method, run in totals.items():
        outputs = run.get("outputs") or {}
        if method == BASELINE or not outputs or None in outputs.values() or None in base_outputs.values():
            continue  # a server that returned no token ids: outputs are not compared
        mismatched = [pid for pid, tokens in outputs.items() if tokens != base_outputs.get(pid)]
        methods[method].update(lossless=not mismatched, mismatched_prompts=mismatched)
        if mismatched:
            log.error("NOT LOSSLESS: %s's output differs from target-only greedy decoding at batch size %d on %d of %d "
                      "prompts: %s", method, concurrency, len(mismatched), len(outputs), mismatched[:10])
    return df, methods


def size_checks(entry: dict, totals: dict, size: int, prompts: int) -> dict:
    """What a size adds to a method's per_batch_size entry: its wall time and requests in flight; for the draft, the
    counters over the size and, at size 1, whether each request's own counters add up to them (at a larger size the
    engine's counters cannot be split by request); and whether its outputs equalled target-only greedy's."""
    extra = {"wall_seconds": totals["wall_seconds"], "in_flight": min(size, prompts)}
    counters = totals.get("counters")
    if counters is not None:
        per_request = totals.get("per_request_counters")
        extra.update(counters=counters, per_request_counters=per_request,
                     requests_add_up=None if per_request is None else per_request == counters)
    for key in ("lossless", "mismatched_prompts"):
        if key in entry:
            extra[key] = entry[key]
    return extra


def summarise_sweep(rows: list[dict], runs: dict, k: int, sizes: list[int], prompts: int) -> tuple:
    """The per-prompt table of every size and the summary's methods: each method's figures at the smallest size, every
    size's in `per_batch_size` (draftsmith.benchmark.results.add_per_batch_size), the counters over all sizes, and whether the sizes'
    counters add up to them."""
    import pandas as pd

    frames, by_size, extras = [], {}, {}
    for size in sizes:
        totals = {method: run["sizes"][size] for method, run in runs.items()}
        df, by_size[size] = summarise_runs([r for r in rows if r["batch_size"] == size], totals, k, size)
        frames.append(df)
        extras[size] = {m: size_checks(e, totals[m], size, prompts) for m, e in by_size[size].items()}
        for method, extra in extras[size].items():
            if extra.get("requests_add_up") is False:
                log.error("COUNTERS DO NOT ADD UP: %s at batch size %d: the requests' own counter deltas sum to %s, "
                          "the size's delta is %s", method, size, extra["per_request_counters"], extra["counters"])
    methods = add_per_batch_size(by_size, BASELINE, extras)
    for method, run in runs.items():
        if run.get("counters") is None:
            continue
        by_sizes = sum_counters([run["sizes"][s]["counters"] for s in sizes])
        entry = methods[method]
        entry.update(counters_all_sizes=run["counters"], sizes_add_up=by_sizes == run["counters"])
        if not entry["sizes_add_up"]:
            log.error("COUNTERS DO NOT ADD UP: %s: the batch sizes' counter deltas sum to %s, the whole run's delta is "
                      "%s (did another client use the server?)", method, by_sizes, run["counters"])
    for method, entry in methods.items():
        per_size = [e for e in entry["per_batch_size"].values() if "lossless" in e]
        if len(per_size) > 1:
            entry["lossless"] = all(e["lossless"] for e in per_size)
            entry["mismatched_prompts"] = sorted({p for e in per_size for p in e["mismatched_prompts"]}, key=str)
    return pd.concat(frames, ignore_index=True), methods


def baseline_fingerprint(target: TargetSpec, prompts: list[dict], cfg: dict) -> str:
    """Everything the target-only run depends on (the port is chosen per run and left out)."""
    inputs = {"target": target.to_dict(), "prompts": prompts, "benchmark": {k: v for k, v in cfg.items() if k != "port"}}
    return sha256_bytes(json.dumps(inputs, sort_keys=True, default=str).encode())


def _kept_run(run: dict) -> dict:
    """A run as read back from BASELINE_FILE: its sizes are int keys again (JSON made them strings)."""
    return {**run, "sizes": {int(size): totals for size, totals in run["sizes"].items()}}


def run_vllm_benchmark(target: TargetSpec, draft_dir, prompts: list[dict], cfg: dict, out_per_prompt: Path,
                       out_summary: Path, variant: str, make_command=serve_command) -> dict:
    """Benchmark target-only and EAGLE-3 serving with vLLM at every batch size; write per_prompt.csv and summary.json.

    One server per method (the target alone, then with the draft), each started once and run at every size of
    `batch_sizes(cfg)` in turn. The server logs go beside the summary (vllm_serve_<method>.log). The target-only run
    is kept beside them (BASELINE_FILE, keyed by a fingerprint of target, prompts and settings) before the draft's
    server starts, so a draft server that fails costs only its own run: the rerun reuses the baseline.
    """
    if cfg["temperature"] != 0.0:
        raise ValueError("benchmark.temperature: only greedy decoding (0) is measured")
    check_cpu_test_worker(cfg)
    if not prompts:
        raise ValueError("no benchmark prompts")
    if any("follow_up" in p for p in prompts):
        raise ValueError("prompts with a follow_up turn (benchmark.mt_bench.turns: 2) run on the offline backend only")
    k = cfg["num_speculative_tokens"]
    sizes = batch_sizes(cfg, "vllm")
    logs = Path(out_summary).parent
    kept = logs / BASELINE_FILE
    fingerprint = baseline_fingerprint(target, prompts, cfg)
    previous = read_json(kept, rebuild="delete it: the benchmark then runs the target alone again") if kept.exists() else None
    rows, runs = [], {}
    if previous is not None and previous.get("fingerprint") == fingerprint and "run" in previous:
        log.info("reusing the target-only run kept in %s (same target, prompts and settings)", kept)
        rows, runs[BASELINE] = previous["rows"], _kept_run(previous["run"])
    elif previous is not None:
        log.info("%s was measured with other inputs: measuring the target-only run again", kept)
    todo = [(METHOD, draft_dir)] if runs else [(BASELINE, None), (METHOD, draft_dir)]
    for method, draft in todo:
        port = cfg["port"] or free_port()
        cmd = make_command(target, cfg, port, draft)
        try:
            with VllmServer(cmd, port, logs / f"vllm_serve_{method}.log", cfg["server_timeout_s"]) as server:
                method_rows, runs[method] = run_sizes(server, prompts, cfg, method, variant, sizes)
        except ServerError as e:
            if method == METHOD and BASELINE in runs:
                raise ServerError(f"{e}\n(the target-only run is kept in {kept} and is reused when this is re-run)") from e
            raise
        rows += method_rows
        if method == BASELINE:
            write_json(kept, {"fingerprint": fingerprint, "rows": method_rows, "run": runs[BASELINE]})
    df, methods = summarise_sweep(rows, runs, k, sizes, len(prompts))
    outputs = {size: {method: run["sizes"][size].get("outputs") for method, run in runs.items()} for size in sizes}
    write_json(logs / OUTPUTS_FILE, outputs[sizes[0]])
    if len(sizes) > 1:
        write_json(logs / OUTPUTS_BY_SIZE_FILE, {str(size): out for size, out in outputs.items()})
    with atomic_path(out_per_prompt, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)
    summary = {"variant": variant, "backend": "vllm", "device": device_summary(cfg), "num_speculative_tokens": k,
               "max_new_tokens": cfg["max_new_tokens"], "num_prompts": len(prompts), "batch_sizes": sizes,
               "acceptance_length": ACCEPTANCE_LENGTH, "speculative_config": speculative_config(draft_dir, k, cfg["cpu_test_worker"]),
               "cpu_test_worker": CPU_TEST_WORKER if cfg["cpu_test_worker"] else None,
               "methods": methods, "versions": package_versions()}
    write_json(out_summary, summary)
    log.info("vllm benchmark: speedup by batch size %s",
             {m: {s: round(e["speedup"], 3) for s, e in entry["per_batch_size"].items()} for m, entry in methods.items()})
    return summary
