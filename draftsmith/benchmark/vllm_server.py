"""`vllm serve` as a process: its command line (target alone, or with the draft as EAGLE-3 speculator), the server
in its own process group (started, waited for, always stopped: SIGTERM then SIGKILL to the group), its HTTP calls
(/health, /metrics, /v1/chat/completions), and the root cause quoted from its log when it fails.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from draftsmith.benchmark.prometheus import spec_decode_counters
from draftsmith.config.batch_sizes import batch_sizes
from draftsmith.devices import visible_gpu_count
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vllm_stack.probes import CPU_TEST_WORKER

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """vllm serve did not come up, or died; the message carries the end of its log."""


# ----------------------------------------------------------------------------- command and config


def speculative_config(draft_dir: str | Path, num_speculative_tokens: int, cpu_test_worker: bool = False) -> dict:
    spec = {"model": str(draft_dir), "num_speculative_tokens": int(num_speculative_tokens), "method": "eagle3"}
    if cpu_test_worker:  # vLLM's padded drafter batch runs Triton kernels; its unpadded path is plain torch
        spec["disable_padded_drafter_batch"] = True
    return spec


def check_cpu_test_worker(cfg: dict, gpus: int | None = None) -> None:
    """benchmark.cpu_test_worker is a test harness for vLLM's CPU platform: an error where a GPU is visible."""
    gpus = visible_gpu_count() if gpus is None else gpus
    if cfg["cpu_test_worker"] and gpus > 0:
        raise ValueError(f"benchmark.cpu_test_worker: true, but {gpus} GPU(s) are visible: the test-only CPU worker "
                         f"({CPU_TEST_WORKER}) refuses to run on a GPU platform, where vLLM's own worker serves EAGLE-3 "
                         "drafts; set benchmark.cpu_test_worker: false")


def serve_command(target: TargetSpec, cfg: dict, port: int, draft_dir: str | Path | None = None) -> list[str]:
    """The `vllm serve` command line for the target, with the draft as EAGLE-3 speculator when given.

    With benchmark.cpu_test_worker (tests on vLLM's CPU platform only), the draft's server runs draftsmith's test-only
    worker (--worker-cls), and both servers run eagerly (--enforce-eager: no torch.compile, which takes minutes on a
    small CPU and is not what the test is about)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", target.model,
           "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "target",
           "--seed", str(cfg["seed"]),
           "--tensor-parallel-size", str(cfg["tensor_parallel_size"]),
           "--gpu-memory-utilization", str(cfg["gpu_memory_utilization"]),
           "--max-num-seqs", str(max(batch_sizes(cfg, "vllm"))),
           # the same prompts run at every batch size: none may find its prompt cached by an earlier size
           "--no-enable-prefix-caching",
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
    test_worker = cfg["cpu_test_worker"]
    if test_worker:
        cmd += ["--enforce-eager"]
    if draft_dir is not None:
        spec = speculative_config(draft_dir, cfg["num_speculative_tokens"], test_worker)
        cmd += ["--speculative-config", json.dumps(spec)]
        if test_worker:
            cmd += ["--worker-cls", CPU_TEST_WORKER]
    return cmd


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
        """One greedy chat completion: prompt and completion token counts, the seconds it took, and the generated
        token ids (`output_token_ids`; None from a server that does not return them)."""
        import requests

        body = {"model": "target", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "seed": seed,
                "return_token_ids": True}  # vLLM's extension: the choice's token ids, to compare outputs exactly
        start = time.perf_counter()
        response = requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=3600)
        seconds = time.perf_counter() - start
        if response.status_code != 200:
            raise ServerError(f"chat completion failed ({response.status_code}): {response.text[:500]}")
        reply = response.json()
        usage = reply["usage"]
        return {"prompt_tokens": usage["prompt_tokens"], "new_tokens": usage["completion_tokens"], "seconds": seconds,
                "output_token_ids": reply["choices"][0].get("token_ids")}
