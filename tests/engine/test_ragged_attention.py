"""The engine's ragged attention (draftsmith.decoding.ragged_attention, a Triton kernel) in Triton's interpreter on
the CPU: against SDPA on random tensors, and the engine's answers with it (regenerate's decode steps, the benchmark's
verifications) against SDPA over the whole cache through masks (the checks in ragged_checks.py, each in a process of
its own with TRITON_INTERPRET=1).

Triton comes with the engine stack (envs/vllm-cpu.lock.txt, as with CUDA builds of torch), so `make test-engine` runs
this module; the core venv has no Triton and skips it. Its speed is measured on a GPU only
(`python -m perf regenerate_throughput --ragged`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from draftsmith.decoding.batch_target import BatchTarget  # noqa: E402
from draftsmith.decoding.engine_proposers import BatchEagle3Proposer  # noqa: E402
from draftsmith.draft_model import build_draft  # noqa: E402
from draftsmith.decoding.target import TargetModel  # noqa: E402
from draftsmith.target_model.spec import TargetSpec  # noqa: E402

HERE = Path(__file__).resolve().parent


def interpreted(*args) -> str:
    """Run a check of ragged_checks.py in Triton's interpreter; its output, or a failure showing it."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "ragged_checks.py"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("heads,kv_heads,dim,queries", [(9, 3, 64, 1), (9, 3, 64, 4), (4, 2, 16, 1), (4, 4, 32, 2),
                                                       (6, 2, 80, 5)])
def test_the_kernel_equals_sdpa_over_each_rows_own_slots(heads, kv_heads, dim, queries):
    """One query token a row (a decode step) or several (a verification, each token up to its own slot)."""
    assert "max |kernel - sdpa|" in interpreted("kernel_against_sdpa", heads, kv_heads, dim, queries)


def test_the_decoder_with_ragged_steps_answers_as_the_sdpa_steps_do(tiny_target):
    """Greedy and sampled, rows refilled mid-decode, in float32: the same answers as SDPA over the whole cache."""
    assert "ragged answers equal SDPA's over the whole cache" in interpreted("decoder_against_sdpa", tiny_target)


def test_speculative_decoding_with_ragged_verifications_matches_the_sdpa_steps(tiny_target):
    """EAGLE-3 (an untrained draft: k drafts every round) and prompt lookup, at 1 and 3 in flight, in float32."""
    assert "ragged verifications equal SDPA's over the whole cache" in interpreted("verification_against_sdpa",
                                                                                    tiny_target)


def test_the_step_costs_run_through_the_ragged_target_and_draft(tiny_target):
    assert "ragged step costs measured at 1 and 3 rows" in interpreted("step_costs_ragged", tiny_target)


def test_ragged_steps_where_triton_cannot_run_fail_at_construction(tiny_target, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = TargetSpec(str(tiny_target)).load_causal_lm(torch.float32).eval()
    with pytest.raises(ValueError, match="ragged attention: Triton kernels need a CUDA device"):
        BatchTarget(TargetModel(model), ragged=True)
    draft = build_draft(TargetSpec(str(tiny_target)), torch.zeros(model.config.vocab_size, dtype=torch.long),
                        torch.ones(model.config.vocab_size, dtype=torch.bool), 1, [0, 1, 2]).eval()
    with pytest.raises(ValueError, match="ragged attention: Triton kernels need a CUDA device"):
        BatchEagle3Proposer(draft, ragged=True)
