"""The test-only CPU worker's own parts (draftsmith/vllm_stack/cpu_spec_worker.py), in seconds: what the installed vLLM
needs from it, its greedy rejection rule, and its refusals. The whole worker serving a draft is tested by
test_engine_pipeline.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from engine_support import engine_unavailable

REASON = engine_unavailable()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

import torch  # noqa: E402
import vllm.platforms  # noqa: E402

from draftsmith.vllm_stack import cpu_spec_worker as worker  # noqa: E402
from draftsmith.vllm_stack.probes import cpu_spec_decode_fixes  # noqa: E402

pytestmark = pytest.mark.engine


def test_the_installed_vllm_needs_every_change_the_worker_makes():
    fixes = {f.name: f for f in cpu_spec_decode_fixes()}
    assert all(f.needed for f in fixes.values()), [f for f in fixes.values() if not f.needed]
    assert "assert self.speculative_config is None" in fixes["cpu_runner_assertion"].evidence
    assert "rejection_greedy_sample_kernel" in fixes["greedy_rejection_in_torch"].evidence


def test_greedy_rejection_follows_vllms_kernel():
    """Per request: the target's argmax at each draft position up to and including the first mismatch; the bonus
    token when every draft was accepted; -1 (vLLM's placeholder) in the unused slots."""
    #                request 0: all 3 accepted   request 1: 2nd rejected   request 2: no drafts   request 3: 1st rejected
    drafts = torch.tensor([5, 6, 7, 1, 9, 4, 2, 3])
    argmax = torch.tensor([5, 6, 7, 1, 8, 4, 0, 3])
    bonus = torch.tensor([[70], [71], [72], [73]])
    out = worker.greedy_rejection(drafts, [3, 3, 0, 2], 3, argmax, bonus)
    assert out.dtype == torch.int32
    assert out.tolist() == [[5, 6, 7, 70], [1, 8, -1, -1], [72, -1, -1, -1], [0, -1, -1, -1]]
    assert worker.PLACEHOLDER == -1


def test_the_worker_refuses_a_gpu_platform(monkeypatch):
    worker.refuse_unless_cpu_platform()  # vLLM's CPU platform, no CUDA device: accepted
    gpu = SimpleNamespace(is_cpu=lambda: False, device_type="cuda")
    monkeypatch.setattr(vllm.platforms, "_current_platform", gpu)  # as vLLM detects a GPU node
    with pytest.raises(worker.CpuSpecWorkerError, match="test harness for vLLM's CPU platform.*'cuda' platform"):
        worker.refuse_unless_cpu_platform()
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(worker.CpuSpecWorkerError, match="where a CUDA device is visible"):
        worker.refuse_unless_cpu_platform()


def test_the_worker_needs_an_eagle_config_without_the_padded_drafter_batch():
    with pytest.raises(worker.CpuSpecWorkerError, match="speculative decoding only"):
        worker.check_speculative_config(None)
    eagle = SimpleNamespace(use_eagle=lambda: True, method="eagle3", disable_padded_drafter_batch=False)
    with pytest.raises(worker.CpuSpecWorkerError, match="disable_padded_drafter_batch"):
        worker.check_speculative_config(eagle)
    ngram = SimpleNamespace(use_eagle=lambda: False, method="ngram", disable_padded_drafter_batch=True)
    with pytest.raises(worker.CpuSpecWorkerError, match="EAGLE drafts only"):
        worker.check_speculative_config(ngram)
    worker.check_speculative_config(SimpleNamespace(use_eagle=lambda: True, method="eagle3",
                                                    disable_padded_drafter_batch=True))
