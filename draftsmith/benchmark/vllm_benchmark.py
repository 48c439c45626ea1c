"""The `vllm` benchmark backend: the trained draft served by `vllm serve` as an EAGLE-3 speculative model.

Two server runs on the same prompts: the target alone (`target_greedy`), then the target with the
draft (`eagle3_draft`, `--speculative-config` with method eagle3 and k from config). Throughput
comes from the responses (completion tokens over request time); acceptance from vLLM's
Prometheus spec-decode counters. At concurrency 1 the counters are read before and after each
request, so every prompt gets its own acceptance; at higher concurrency only the totals are
known and go into the summary. The server is always stopped (its whole process group), also
when something fails. Results are the tables of draftsmith.benchmark.results, as for the offline backend.
The server process and its command are draftsmith.benchmark.vllm_server; the counters, draftsmith.benchmark.prometheus.
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
from draftsmith.devices import gpu_name
from draftsmith.io import atomic_path, read_json, sha256_bytes, write_json
from draftsmith.provenance import device_description, package_versions
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vllm_stack.probes import CPU_TEST_WORKER

log = logging.getLogger(__name__)

METHOD = "eagle3_draft"
BASELINE_FILE = "target_only_run.json"
OUTPUTS_FILE = "vllm_outputs.json"  # beside the summary: {method: {prompt_id: generated token ids}}
# the one definition used in every summary (the offline backend's too); vLLM's own "mean acceptance
# length", 1 + accepted / drafts, leaves out the prefill's token and is not reported
ACCEPTANCE_LENGTH = "generated tokens per target forward pass (the prefill and each verification), bonus token included"


# ----------------------------------------------------------------------------- the runs


def run_method(server: VllmServer, prompts: list[dict], cfg: dict, method: str, variant: str) -> tuple[list[dict], dict]:
    """All prompts on one server; returns the rows and the run's totals (wall seconds, counter deltas, and each
    prompt's generated token ids as `outputs`)."""
    from tqdm import tqdm

    k, max_tokens, seed = cfg["num_speculative_tokens"], cfg["max_new_tokens"], cfg["seed"]
    concurrency = max(1, cfg["concurrency"])
    server.chat(prompts[0]["messages"], min(8, max_tokens), seed)  # warm-up
    speculative = method == METHOD
    before_all = server.metrics(k) if speculative else None
    rows, outputs = [], {}
    start = time.perf_counter()

    def row(prompt, result, delta):
        result = dict(result)
        outputs[prompt["prompt_id"]] = result.pop("output_token_ids", None)
        base = {"variant": variant, "backend": "vllm", "method": method, "prompt_id": prompt["prompt_id"],
                "category": prompt["category"], **result}
        if not speculative:
            return {**base, "target_forwards": result["new_tokens"], "drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        if delta is None:  # concurrent requests: per-request counters are not separable
            return {**base, "target_forwards": math.nan, "drafts": math.nan, "draft_tokens": math.nan,
                    "accepted_tokens": math.nan, **{c: math.nan for c in accept_columns(k)}}
        return {**base, "target_forwards": 1 + delta["drafts"],  # the prefill, then one verification per draft
                "drafts": delta["drafts"], "draft_tokens": delta["draft_tokens"], "accepted_tokens": delta["accepted"],
                **dict(zip(accept_columns(k), delta["accepted_per_pos"]))}

    with tqdm(total=len(prompts), desc=f"vllm {method}", unit="prompt") as bar:
        if concurrency == 1:
            for prompt in prompts:
                before = server.metrics(k) if speculative else None
                result = server.chat(prompt["messages"], max_tokens, seed)
                delta = counter_delta(server.metrics(k), before) if speculative else None
                rows.append(row(prompt, result, delta))
                bar.update()
        else:
            with ThreadPoolExecutor(concurrency) as pool:
                futures = [pool.submit(server.chat, p["messages"], max_tokens, seed) for p in prompts]
                for prompt, future in zip(prompts, futures):
                    rows.append(row(prompt, future.result(), None))
                    bar.update()
    totals = {"wall_seconds": time.perf_counter() - start, "outputs": outputs}
    if speculative:
        totals["counters"] = counter_delta(server.metrics(k), before_all)
    return rows, totals


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
            log.error("NOT LOSSLESS: %s's output differs from target-only greedy decoding on %d of %d prompts: %s",
                      method, len(mismatched), len(outputs), mismatched[:10])
    return df, methods


def baseline_fingerprint(target: TargetSpec, prompts: list[dict], cfg: dict) -> str:
    """Everything the target-only run depends on (the port is chosen per run and left out)."""
    inputs = {"target": target.to_dict(), "prompts": prompts, "benchmark": {k: v for k, v in cfg.items() if k != "port"}}
    return sha256_bytes(json.dumps(inputs, sort_keys=True, default=str).encode())


def run_vllm_benchmark(target: TargetSpec, draft_dir, prompts: list[dict], cfg: dict, out_per_prompt: Path,
                       out_summary: Path, variant: str, make_command=serve_command) -> dict:
    """Benchmark target-only and EAGLE-3 serving with vLLM; write per_prompt.csv and summary.json.

    The server logs go beside the summary (vllm_serve_<method>.log). The target-only run is kept beside
    them (BASELINE_FILE, keyed by a fingerprint of target, prompts and settings) before the draft's
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
    concurrency = max(1, cfg["concurrency"])
    logs = Path(out_summary).parent
    kept = logs / BASELINE_FILE
    fingerprint = baseline_fingerprint(target, prompts, cfg)
    previous = read_json(kept, rebuild="delete it: the benchmark then runs the target alone again") if kept.exists() else None
    rows, totals = [], {}
    if previous is not None and previous.get("fingerprint") == fingerprint:
        log.info("reusing the target-only run kept in %s (same target, prompts and settings)", kept)
        rows, totals[BASELINE] = previous["rows"], previous["totals"]
    elif previous is not None:
        log.info("%s was measured with other inputs: measuring the target-only run again", kept)
    runs = [(METHOD, draft_dir)] if totals else [(BASELINE, None), (METHOD, draft_dir)]
    for method, draft in runs:
        port = cfg["port"] or free_port()
        cmd = make_command(target, cfg, port, draft)
        try:
            with VllmServer(cmd, port, logs / f"vllm_serve_{method}.log", cfg["server_timeout_s"]) as server:
                method_rows, totals[method] = run_method(server, prompts, cfg, method, variant)
        except ServerError as e:
            if method == METHOD and BASELINE in totals:
                raise ServerError(f"{e}\n(the target-only run is kept in {kept} and is reused when this is re-run)") from e
            raise
        rows += method_rows
        if method == BASELINE:
            write_json(kept, {"fingerprint": fingerprint, "rows": method_rows, "totals": totals[BASELINE]})
    df, methods = summarise_runs(rows, totals, k, concurrency)
    write_json(logs / OUTPUTS_FILE, {method: run.get("outputs") for method, run in totals.items()})
    with atomic_path(out_per_prompt, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)
    summary = {"variant": variant, "backend": "vllm", "device": device_summary(cfg), "num_speculative_tokens": k,
               "max_new_tokens": cfg["max_new_tokens"], "num_prompts": len(prompts), "concurrency": concurrency,
               "acceptance_length": ACCEPTANCE_LENGTH, "speculative_config": speculative_config(draft_dir, k, cfg["cpu_test_worker"]),
               "cpu_test_worker": CPU_TEST_WORKER if cfg["cpu_test_worker"] else None,
               "methods": methods, "versions": package_versions()}
    write_json(out_summary, summary)
    log.info("vllm benchmark: %s", {m: round(e["speedup"], 3) for m, e in methods.items()})
    return summary
