"""TEST HARNESS, NOT FOR PRODUCTION: a vLLM worker that runs EAGLE-3 speculative decoding on vLLM's CPU platform.

vLLM 0.16 cannot do speculative decoding on a CPU by itself. This worker exists so that the real engine (its
scheduler, spec-decode bookkeeping and Prometheus counters, its Eagle3 model class loading draftsmith's trained
checkpoint, its EAGLE proposer) can be tested on a machine without a GPU, and its counters compared prompt by prompt
with draftsmith's offline benchmark. Its speed says nothing about serving on a GPU. It refuses to load anywhere but
vLLM's CPU platform: on a GPU node, `vllm serve` runs vLLM's own GPU worker, which needs none of this.

It is selected only through vLLM's worker-class option (`vllm serve ... --worker-cls WORKER_CLS`, which the CPU
platform keeps instead of its own `CPUWorker`), and draftsmith passes that only with `benchmark.cpu_test_worker: true`
(draftsmith.benchmark.vllm_server.serve_command). What it changes, each probed in the installed source by
`draftsmith.vllm_stack.probes.cpu_spec_decode_fixes()`
(preflight reports them):

- `CPUModelRunner.__init__` ends with `assert self.speculative_config is None, "spec decode is not supported."`:
  the runner here does what that __init__ does, without the assertion.
- `CPUModelRunner.load_model` loads the target only: the runner here also loads the drafter (vLLM's
  `EagleProposer.load_model`, so vLLM's own Eagle3 model class and weight loader) and sets the target's auxiliary
  layers from the draft config, as `GPUModelRunner.load_model` does.
- `GPUModelRunner._copy_draft_token_ids_to_cpu` copies the drafts on a CUDA stream: here a plain copy.
- the rejection sampler's greedy path is a Triton kernel (`rejection_greedy_sample_kernel`): here the same rule in
  torch (draft tokens accepted while they equal the target's argmax; the target's token at the first mismatch, or
  the bonus token after the last draft). Only greedy requests (temperature 0) are accepted.
- the padded drafter batch runs Triton kernels (`prepare_next_token_ids_padded`, `prepare_inputs_padded`): the
  speculative config must set `disable_padded_drafter_batch: true` (vLLM's own unpadded path, plain torch).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

from draftsmith.vllm_stack.probes import CPU_TEST_WORKER as WORKER_CLS


class CpuSpecWorkerError(RuntimeError):
    """The test-only CPU worker cannot run here (a GPU platform, or settings it does not support)."""


# ----------------------------------------------------------------------------- the platform guard


def refuse_unless_cpu_platform() -> None:
    """Raise CpuSpecWorkerError unless vLLM runs on its CPU platform with no CUDA device visible."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise CpuSpecWorkerError(
            f"{WORKER_CLS} is a test harness for vLLM's CPU platform and refuses to load on the "
            f"{current_platform.device_type or 'unknown'!r} platform: on a GPU, vLLM's own worker serves EAGLE-3 drafts "
            "(set benchmark.cpu_test_worker: false)")
    if torch.cuda.is_available():
        raise CpuSpecWorkerError(f"{WORKER_CLS} is a test harness for vLLM's CPU platform and refuses to load where a "
                                 "CUDA device is visible (set benchmark.cpu_test_worker: false)")


refuse_unless_cpu_platform()  # at import, in every process that would use it: before any of vLLM's worker code loads

import torch  # noqa: E402
from vllm.model_executor.models.interfaces import supports_eagle3  # noqa: E402
from vllm.v1.outputs import SamplerOutput  # noqa: E402
from vllm.v1.sample import rejection_sampler as _rejection  # noqa: E402
from vllm.v1.worker import cpu_worker as _cpu_worker  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner, _torch_cuda_wrapper  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

PLACEHOLDER = int(getattr(_rejection.PLACEHOLDER_TOKEN_ID, "value", _rejection.PLACEHOLDER_TOKEN_ID))


def check_speculative_config(spec) -> None:
    if spec is None:
        raise CpuSpecWorkerError(f"{WORKER_CLS} serves speculative decoding only; without a speculative config vLLM's "
                                 "own CPUWorker is the one to use")
    if not (spec.use_eagle() and spec.method in ("eagle", "eagle3")):
        raise CpuSpecWorkerError(f"{WORKER_CLS} runs EAGLE drafts only (method eagle3), not {spec.method!r}")
    if not spec.disable_padded_drafter_batch:
        raise CpuSpecWorkerError(f"{WORKER_CLS} needs \"disable_padded_drafter_batch\": true in --speculative-config "
                                 "(the padded drafter batch runs Triton kernels)")


# ----------------------------------------------------------------------------- greedy rejection in torch


def greedy_rejection(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                     target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's `rejection_greedy_sample_kernel` in torch: per request, the target's argmax at each draft position up
    to and including the first mismatch, then the bonus token if every draft was accepted; PLACEHOLDER elsewhere.
    Returns [batch, max_spec_len + 1] int32."""
    out = torch.full((len(num_draft_tokens), max_spec_len + 1), PLACEHOLDER, dtype=torch.int32,
                     device=target_argmax.device)
    drafts, argmax, bonus = draft_token_ids.tolist(), target_argmax.tolist(), bonus_token_ids.view(-1).tolist()
    start = 0
    for i, n in enumerate(num_draft_tokens):
        accepted = 0
        while accepted < n and drafts[start + accepted] == argmax[start + accepted]:
            accepted += 1
        tokens = argmax[start:start + accepted + 1] if accepted < n else argmax[start:start + n] + [bonus[i]]
        out[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        start += n
    return out


class TorchGreedyRejectionSampler(_rejection.RejectionSampler):
    """RejectionSampler.forward for all-greedy batches, with the greedy rule in torch instead of Triton."""

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        if not sampling_metadata.all_greedy:
            raise CpuSpecWorkerError(f"{WORKER_CLS} verifies greedy requests only (temperature 0): random rejection "
                                     "sampling runs Triton kernels")
        assert metadata.max_spec_len <= _rejection.MAX_SPEC_LEN
        bonus_logits = logits[metadata.bonus_logits_indices]
        bonus = self.sampler(logits=bonus_logits, sampling_metadata=replace(sampling_metadata, max_num_logprobs=-1),
                             predict_bonus_token=True,
                             logprobs_mode_override="processed_logits" if self.is_processed_logprobs_mode else "raw_logits")
        raw_target_logits = logits[metadata.target_logits_indices].to(torch.float32)
        target_logits = raw_target_logits if self.is_processed_logprobs_mode else raw_target_logits.clone()
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata, metadata)
        output = greedy_rejection(metadata.draft_token_ids, metadata.num_draft_tokens, metadata.max_spec_len,
                                  target_logits.argmax(dim=-1), bonus.sampled_token_ids)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus.logprobs_tensors.logprobs, output)
        return SamplerOutput(sampled_token_ids=output, logprobs_tensors=logprobs)


# ----------------------------------------------------------------------------- the model runner and the worker


class CPUSpecDecodeModelRunner(CPUModelRunner):
    """vLLM's CPUModelRunner with an EAGLE drafter (see the module docstring for each change)."""

    def __init__(self, vllm_config, device: torch.device):
        check_speculative_config(vllm_config.speculative_config)
        # CPUModelRunner.__init__, without its `assert self.speculative_config is None`
        with _torch_cuda_wrapper():
            GPUModelRunner.__init__(self, vllm_config, device)
        if device != torch.device("cpu"):
            raise CpuSpecWorkerError(f"{WORKER_CLS} runs on the CPU device, not {device}")
        self.use_cuda_graph = False
        self.cascade_attn_enabled = False
        self._postprocess_tensors()
        self.rejection_sampler = TorchGreedyRejectionSampler(self.sampler)

    def load_model(self, eep_scale_up: bool = False) -> None:
        super().load_model(eep_scale_up)  # the target
        self.drafter.load_model(self.model)  # vLLM's Eagle3 model class and weight loader, as GPUModelRunner does
        if self.use_aux_hidden_state_outputs:
            if not supports_eagle3(self.model):
                raise CpuSpecWorkerError(f"{type(self.model).__name__} does not support vLLM's EAGLE-3 interface")
            aux_layers = self._get_eagle3_aux_layers_from_config() or self.model.get_eagle3_aux_hidden_state_layers()
            self.model.set_aux_hidden_state_layers(aux_layers)

    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only: bool = False) -> None:
        """GPUModelRunner's copy of the drafts to the host, without its CUDA stream and event."""
        if self.use_async_scheduling:
            raise CpuSpecWorkerError(f"{WORKER_CLS} runs with synchronous scheduling only (vLLM's CPU platform default)")
        self._draft_token_req_ids = self.input_batch.req_ids.copy()
        drafts = self._draft_token_ids
        if not torch.is_tensor(drafts):
            return
        if zeros_only:
            self.draft_token_ids_cpu[: drafts.shape[0]] = 0
        else:
            self.draft_token_ids_cpu[: drafts.shape[0]].copy_(drafts)


@contextlib.contextmanager
def _cpu_worker_builds(runner_cls):
    """CPUWorker.init_device builds `CPUModelRunner(...)` by that module-level name: build `runner_cls` instead
    while it runs (this worker process only)."""
    original = _cpu_worker.CPUModelRunner
    _cpu_worker.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        _cpu_worker.CPUModelRunner = original


class CPUSpecDecodeWorker(_cpu_worker.CPUWorker):
    """vLLM's CPUWorker with CPUSpecDecodeModelRunner (TEST HARNESS, NOT FOR PRODUCTION)."""

    def __init__(self, vllm_config, *args, **kwargs):
        refuse_unless_cpu_platform()
        check_speculative_config(vllm_config.speculative_config)
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self) -> None:
        with _cpu_worker_builds(CPUSpecDecodeModelRunner):
            super().init_device()
        if not isinstance(self.model_runner, CPUSpecDecodeModelRunner):
            raise CpuSpecWorkerError(f"CPUWorker.init_device built {type(self.model_runner).__name__}, not "
                                     "CPUSpecDecodeModelRunner: the installed vLLM builds its runner another way")
