"""The `vllm` benchmark backend: the trained draft served by `vllm serve` as an EAGLE-3 speculative model.

Two server runs on the same prompts: the target alone (`target_greedy`), then the target with the
draft (`eagle3_draft`, `--speculative-config` with method eagle3 and k from config). Throughput
comes from the responses (completion tokens over request time); acceptance from vLLM's
Prometheus spec-decode counters. At concurrency 1 the counters are read before and after each
request, so every prompt gets its own acceptance; at higher concurrency only the totals are
known and go into the summary. The server is always stopped (its whole process group), also
when something fails. Results are the tables of draftsmith.benchmark.results, as for the offline backend.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from draftsmith.benchmark.results import BASELINE, accept_columns, finish_rows, summarise
from draftsmith.devices import gpu_name
from draftsmith.io import atomic_path, read_json, sha256_bytes, write_json
from draftsmith.provenance import device_description, package_versions
from draftsmith.target_model.spec import TargetSpec

log = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
METHOD = "eagle3_draft"
BASELINE_FILE = "target_only_run.json"
# the one definition used in every summary (the offline backend's too); vLLM's own "mean acceptance
# length", 1 + accepted / drafts, leaves out the prefill's token and is not reported
ACCEPTANCE_LENGTH = "generated tokens per target forward pass (the prefill and each verification), bonus token included"


class ServerError(RuntimeError):
    """vllm serve did not come up, or died; the message carries the end of its log."""


# ----------------------------------------------------------------------------- command and config


def speculative_config(draft_dir: str | Path, num_speculative_tokens: int) -> dict:
    return {"model": str(draft_dir), "num_speculative_tokens": int(num_speculative_tokens), "method": "eagle3"}


def serve_command(target: TargetSpec, cfg: dict, port: int, draft_dir: str | Path | None = None) -> list[str]:
    """The `vllm serve` command line for the target, with the draft as EAGLE-3 speculator when given."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", target.model,
           "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "target",
           "--seed", str(cfg["seed"]),
           "--tensor-parallel-size", str(cfg["tensor_parallel_size"]),
           "--gpu-memory-utilization", str(cfg["gpu_memory_utilization"]),
           "--max-num-seqs", str(max(1, cfg["concurrency"])),
           "--generation-config", "vllm"]  # ignore the model's sampling defaults: greedy is asked per request
    dtype = target.stage_dtype(cfg["dtype"])
    if dtype != "auto":
        cmd += ["--dtype", dtype]
    if cfg["max_model_len"]:
        cmd += ["--max-model-len", str(cfg["max_model_len"])]
    if target.revision:
        cmd += ["--revision", target.revision]
    if target.trust_remote_code:
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


# what the API server says when its engine process died: the engine's own exception, logged above it, is the cause
WRAPPER_ERRORS = ("Engine core initialization failed", "See root cause above", "EngineDeadError")
# vLLM prefixes a child process's lines with "(EngineCore_DP0 pid=N) " and log records with "ERROR 12-03 06:00:00 [core.py:1] "
LINE_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) [\d-]+ [\d:.]+ \[[^\]]*\] ?)?")
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b(?:: .*)?$")


def root_cause(log_text: str) -> str | None:
    """The exception the first traceback in vllm serve's log ends with, unless it is the API server's wrapper."""
    lines = [LINE_PREFIX.sub("", line, count=1) for line in log_text.splitlines()]
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        at = next((j for j in range(i + 1, len(lines)) if EXCEPTION_LINE.match(lines[j])), None)
        if at is None or any(w in lines[at] for w in WRAPPER_ERRORS):
            continue
        # an exception without a message (a bare assert): the source line it was raised at says what failed
        return lines[at] if ": " in lines[at] else f"{lines[at]} at `{lines[at - 1].strip()}`"
    return None


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

    def failure(self, what: str) -> ServerError:
        """The error for a server that died or hung: the engine's root cause first, then the end of the log."""
        text = self.log_tail(lines=10**6)
        cause = root_cause(text)
        head = f"{what}; root cause: {cause}" if cause else what
        return ServerError(f"{head}\nend of {self.log_path}:\n" + "\n".join(text.splitlines()[-30:]))

    def wait_healthy(self) -> None:
        import requests

        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self.failure(f"vllm serve exited with code {self.proc.returncode} before becoming healthy")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    log.info("vllm serve is healthy on port %d", self.port)
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise self.failure(f"vllm serve was not healthy after {self.timeout_s:.0f} s")

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

    k, max_tokens, seed = cfg["num_speculative_tokens"], cfg["max_new_tokens"], cfg["seed"]
    concurrency = max(1, cfg["concurrency"])
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
    if concurrency > 1 and BASELINE in methods:
        for entry in methods.values():
            entry["speedup"] = entry["tokens_per_s"] / methods[BASELINE]["tokens_per_s"]
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
    if not prompts:
        raise ValueError("no benchmark prompts")
    k = cfg["num_speculative_tokens"]
    concurrency = max(1, cfg["concurrency"])
    logs = Path(out_summary).parent
    kept = logs / BASELINE_FILE
    fingerprint = baseline_fingerprint(target, prompts, cfg)
    previous = read_json(kept) if kept.exists() else None
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
    with atomic_path(out_per_prompt, suffix=".csv") as tmp:
        df.to_csv(tmp, index=False)
    summary = {"variant": variant, "backend": "vllm", "device": device_summary(cfg), "num_speculative_tokens": k,
               "max_new_tokens": cfg["max_new_tokens"], "num_prompts": len(prompts), "concurrency": concurrency,
               "acceptance_length": ACCEPTANCE_LENGTH, "speculative_config": speculative_config(draft_dir, k),
               "methods": methods, "versions": package_versions()}
    write_json(out_summary, summary)
    log.info("vllm benchmark: %s", {m: round(e["speedup"], 3) for m, e in methods.items()})
    return summary
