"""The `vllm` benchmark backend: the trained draft served by `vllm serve` as an EAGLE-3 speculative model.

Two server runs on the same prompts: the target alone (`target_greedy`), then the target with the
draft (`eagle3_draft`, `--speculative-config` with method eagle3 and k from config). Throughput
comes from the responses (completion tokens over request time); acceptance from vLLM's
Prometheus spec-decode counters. At concurrency 1 the counters are read before and after each
request, so every prompt gets its own acceptance; at higher concurrency only the totals are
known and go into the summary. The server is always stopped (its whole process group), also
when something fails. Results are the tables of draftsmith.bench_results, as for the offline backend.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from draftsmith.bench_results import BASELINE, accept_columns, finish_rows, summarise
from draftsmith.io import atomic_path, write_json

log = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
METHOD = "eagle3_draft"


class ServerError(RuntimeError):
    """vllm serve did not come up, or died; the message carries the end of its log."""


# ----------------------------------------------------------------------------- command and config


def speculative_config(draft_dir: str | Path, num_speculative_tokens: int) -> dict:
    return {"model": str(draft_dir), "num_speculative_tokens": int(num_speculative_tokens), "method": "eagle3"}


def serve_command(target: str, cfg: dict, port: int, draft_dir: str | Path | None = None,
                  trust_remote_code: bool = False, revision: str | None = None) -> list[str]:
    """The `vllm serve` command line for the target, with the draft as EAGLE-3 speculator when given."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(target),
           "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "target",
           "--seed", str(cfg.get("seed", 0)),
           "--tensor-parallel-size", str(cfg.get("tensor_parallel_size", 1)),
           "--gpu-memory-utilization", str(cfg.get("gpu_memory_utilization", 0.9)),
           "--max-num-seqs", str(max(1, cfg.get("concurrency", 1))),
           "--generation-config", "vllm"]  # ignore the model's sampling defaults: greedy is asked per request
    if cfg.get("dtype", "auto") != "auto":
        cmd += ["--dtype", cfg["dtype"]]
    if cfg.get("max_model_len"):
        cmd += ["--max-model-len", str(cfg["max_model_len"])]
    if revision:
        cmd += ["--revision", revision]
    if trust_remote_code:
        cmd += ["--trust-remote-code"]
    if draft_dir is not None:
        cmd += ["--speculative-config", json.dumps(speculative_config(draft_dir, cfg["num_speculative_tokens"]))]
    return cmd


# ----------------------------------------------------------------------------- Prometheus text


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Samples of Prometheus text exposition: {(name, sorted label pairs): value}."""
    samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            labels_text, value_text = rest.rsplit("}", 1)
            labels = tuple(sorted(_parse_labels(labels_text)))
        else:
            name, value_text = line.split(None, 1)
            labels = ()
        samples[(name.strip(), labels)] = float(value_text.split()[0])
    return samples


def _parse_labels(text: str):
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq].strip().lstrip(",").strip()
        j, value = eq + 2, []  # skip ="
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        yield key, "".join(value)
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1


def spec_decode_counters(text: str, k: int) -> dict:
    """vLLM's spec-decode counters, summed over engines: drafts, draft_tokens, accepted, accepted_per_pos[k]."""
    samples = parse_prometheus(text)

    def total(name, **match):
        return sum(v for (n, labels), v in samples.items()
                   if n == f"{name}_total" and all(dict(labels).get(key) == val for key, val in match.items()))

    return {"drafts": total(DRAFTS), "draft_tokens": total(DRAFT_TOKENS), "accepted": total(ACCEPTED),
            "accepted_per_pos": [total(ACCEPTED_PER_POS, position=str(i)) for i in range(k)]}


def counter_delta(after: dict, before: dict) -> dict:
    return {key: [a - b for a, b in zip(after[key], before[key])] if isinstance(after[key], list) else after[key] - before[key]
            for key in after}


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve` in its own process group; `with VllmServer(...) as server:` stops it on any exit."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, timeout_s: float = 1800):
        self.cmd, self.port, self.log_path, self.timeout_s = cmd, port, Path(log_path), timeout_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "VllmServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting: %s (log: %s)", " ".join(self.cmd), self.log_path)
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_healthy(self) -> None:
        import requests

        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"vllm serve exited with code {self.proc.returncode} before becoming healthy; "
                                  f"end of {self.log_path}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    log.info("vllm serve is healthy on port %d", self.port)
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise ServerError(f"vllm serve was not healthy after {self.timeout_s:.0f} s; end of {self.log_path}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 30) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                log.info("vllm serve stopped (%s)", sig.name)
                return
            except subprocess.TimeoutExpired:
                continue

    def metrics(self, k: int) -> dict:
        import requests

        response = requests.get(f"{self.url}/metrics", timeout=30)
        response.raise_for_status()
        return spec_decode_counters(response.text, k)

    def chat(self, messages: list[dict], max_tokens: int, seed: int) -> dict:
        """One greedy chat completion: prompt and completion tokens, and the seconds it took."""
        import requests

        body = {"model": "target", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed}
        start = time.perf_counter()
        response = requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=3600)
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise ServerError(f"chat completion failed ({response.status_code}): {response.text[:500]}")
        usage = response.json()["usage"]
        return {"prompt_tokens": usage["prompt_tokens"], "new_tokens": usage["completion_tokens"], "seconds": seconds}


# ----------------------------------------------------------------------------- the runs


def run_method(server: VllmServer, prompts: list[dict], cfg: dict, method: str, variant: str) -> tuple[list[dict], dict]:
    """All prompts on one server; returns the rows and the run's totals (wall seconds, counter deltas)."""
    from tqdm import tqdm

    k, max_tokens, seed = cfg["num_speculative_tokens"], cfg["max_new_tokens"], cfg.get("seed", 0)
    concurrency = max(1, cfg.get("concurrency", 1))
    server.chat(prompts[0]["messages"], min(8, max_tokens), seed)  # warm-up
    speculative = method == METHOD
    before_all = server.metrics(k) if speculative else None
    rows = []
    start = time.perf_counter()

    def row(prompt, result, delta):
        base = {"variant": variant, "backend": "vllm", "method": method, "prompt_id": prompt["prompt_id"], **result}
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
    totals = {"wall_seconds": time.perf_counter() - start}
    if speculative:
        totals["counters"] = counter_delta(server.metrics(k), before_all)
    return rows, totals


def device_summary(cfg: dict) -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split("\n")[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return f"cuda: {out or 'unknown GPU'} x{cfg.get('tensor_parallel_size', 1)} (vllm serve)"


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
            drafts = counters["drafts"]
            entry["counters"] = counters
            entry["mean_acceptance_length_counters"] = 1 + counters["accepted"] / drafts if drafts else None
        if concurrency > 1:
            entry["seconds"] = run["wall_seconds"]
            entry["tokens_per_s"] = entry["new_tokens"] / run["wall_seconds"]
            if counters is not None:
                entry["acceptance_length"] = entry["new_tokens"] / (entry["prompts"] + counters["drafts"])
                entry["per_position_acceptance"] = [a / counters["drafts"] if counters["drafts"] else None
                                                    for a in counters["accepted_per_pos"]]
    if concurrency > 1 and BASELINE in methods:
        for entry in methods.values():
            entry["speedup"] = entry["tokens_per_s"] / methods[BASELINE]["tokens_per_s"]
    return df, methods


def run_vllm_benchmark(target, draft_dir, prompts: list[dict], cfg: dict, out_per_prompt: Path, out_summary: Path,
                       variant: str, trust_remote_code: bool = False, revision: str | None = None,
                       make_command=serve_command) -> dict:
    """Benchmark target-only and EAGLE-3 serving with vLLM; write per_prompt.csv and summary.json.

    The server logs go beside the summary (vllm_serve_<method>.log).
    """
    from draftsmith.shards import package_versions

    if cfg.get("temperature", 0.0) != 0.0:
        raise ValueError("benchmark.temperature: only greedy decoding (0) is measured")
    if not prompts:
        raise ValueError("no benchmark prompts")
    k = cfg["num_speculative_tokens"]
    concurrency = max(1, cfg.get("concurrency", 1))
    logs = Path(out_summary).parent
    rows, totals = [], {}
    for method, draft in ((BASELINE, None), (METHOD, draft_dir)):
        port = cfg.get("port") or free_port()
        cmd = make_command(target, cfg, port, draft, trust_remote_code, revision)
        with VllmServer(cmd, port, logs / f"vllm_serve_{method}.log", cfg.get("server_timeout_s", 1800)) as server:
            method_rows, totals[method] = run_method(server, prompts, cfg, method, variant)
        rows += method_rows
    df, methods = summarise_runs(rows, totals, k, concurrency)
    with atomic_path(out_per_prompt, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)
    summary = {"variant": variant, "backend": "vllm", "device": device_summary(cfg), "num_speculative_tokens": k,
               "max_new_tokens": cfg["max_new_tokens"], "num_prompts": len(prompts), "concurrency": concurrency,
               "speculative_config": speculative_config(draft_dir, k), "methods": methods, "versions": package_versions()}
    write_json(out_summary, summary)
    log.info("vllm benchmark: %s", {m: round(e["speedup"], 3) for m, e in methods.items()})
    return summary
