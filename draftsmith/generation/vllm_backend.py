"""The `vllm` regenerate backend: vLLM 0.16's offline `LLM` engine (continuous batching, tensor parallel).

The driver renders each prompt with the target tokenizer's chat template to token ids, as for the hf backend, and
this backend hands vLLM those ids (`TokensPrompt`): both backends answer identical prompts. Each chunk is one
`LLM.generate` call; vLLM batches its requests continuously, `batch_size` (`max_num_seqs`) at a time. Sampling
requests carry their own seed (`SamplingParams.seed`: a per-request generator inside vLLM), so an answer does not
depend on the chunk or on the other requests in flight. Generation stops at the driver's stop tokens (the
tokenizer's eos plus the generation config's, draftsmith.target_model.spec.stop_token_ids) or at max_new_tokens.

Why the offline engine and not `vllm serve` with concurrent requests (as speculators' and SpecForge's regeneration
do): see docs/VLLM.md, "Regeneration with vLLM". Importing this module imports vLLM; the driver checks the installed
version first (draftsmith.vllm_stack.installed.vllm_install_problem).
"""

from __future__ import annotations

import logging

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from draftsmith.target_model.spec import TargetSpec

log = logging.getLogger(__name__)


class VllmBackend:
    """`cfg`: dtype (as vLLM takes it: auto, float32, bfloat16, float16), batch_size (max_num_seqs),
    tensor_parallel_size, gpu_memory_utilization, max_model_len (None: the longest prompt + max_new_tokens, at most
    the target's max_position_embeddings). `engine_args`: more keyword arguments for `LLM` (tests: enforce_eager)."""

    name = "vllm"

    def __init__(self, target: TargetSpec, cfg: dict, engine_args: dict | None = None):
        self.target = target
        self.dtype = str(cfg.get("dtype", "auto"))
        self.batch_size = int(cfg.get("batch_size", 16))
        self.tensor_parallel_size = int(cfg.get("tensor_parallel_size", 1))
        self.gpu_memory_utilization = float(cfg.get("gpu_memory_utilization", 0.9))
        self.configured_max_model_len = cfg.get("max_model_len")
        self.max_model_len: int | None = self.configured_max_model_len
        self.engine_args = dict(engine_args or {})
        self.llm: LLM | None = None
        # what else determines the answers (the driver's fingerprint): prompts that do not fit are not answered,
        # and an answer that reaches max_model_len is cut there
        self.settings = {"max_model_len": self.configured_max_model_len}

    def prompt_limit(self, lengths: list[int], max_new_tokens: int) -> int:
        """max_model_len, resolved where not configured: a prompt of this many tokens or more cannot be answered
        (vLLM refuses a prompt that leaves no room for one new token); the driver drops those. An engine already
        running keeps the max_model_len it started with."""
        if self.llm is None and self.configured_max_model_len is None:
            wanted = max(lengths, default=0) + max_new_tokens
            positions = getattr(self.target.load_text_config(), "max_position_embeddings", None)
            self.max_model_len = min(wanted, positions) if positions else wanted
            if positions and wanted > positions:
                log.info("regenerate: max_model_len %d (the target's max_position_embeddings; the longest prompt + "
                         "max_new_tokens would be %d): answers that reach it are cut there", positions, wanted)
        return self.max_model_len

    def _engine(self) -> LLM:
        if self.llm is None:
            if self.max_model_len is None:
                raise RuntimeError("VllmBackend.prompt_limit must run before generate (it resolves max_model_len)")
            args = dict(model=self.target.model, tokenizer=self.target.model, revision=self.target.revision,
                        tokenizer_revision=self.target.revision, trust_remote_code=self.target.trust_remote_code,
                        dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                        gpu_memory_utilization=self.gpu_memory_utilization, max_model_len=self.max_model_len,
                        max_num_seqs=self.batch_size, **self.engine_args)
            log.info("starting vLLM's offline engine for %s: %s", self.target.model,
                     ", ".join(f"{k}={v}" for k, v in args.items() if k != "model"))
            self.llm = LLM(**args)
        return self.llm

    def sampling_params(self, request: dict, gen: dict) -> SamplingParams:
        sampling = gen["temperature"] > 0
        return SamplingParams(
            n=1, max_tokens=gen["max_new_tokens"], temperature=gen["temperature"] if sampling else 0.0,
            top_p=gen["top_p"] if sampling else 1.0, top_k=gen["top_k"] if sampling else 0,
            seed=request["seed"] if sampling else None, stop_token_ids=sorted(gen["stop_ids"]),
            detokenize=False)  # the driver decodes the token ids, as for the hf backend

    def generate(self, requests: list[dict], gen: dict, progress=None) -> list[dict]:
        """One answer per request (`prompt_ids`, `seed`), in order: `token_ids` (without the stop token) and
        `finish_reason` (`stop` or `length`)."""
        llm = self._engine()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(r["prompt_ids"])) for r in requests],
                               [self.sampling_params(r, gen) for r in requests], use_tqdm=False)
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} requests")
        answers = []
        for request, output in zip(requests, outputs):
            if list(output.prompt_token_ids) != list(request["prompt_ids"]):
                raise RuntimeError(f"vLLM answered request {output.request_id} for another prompt than it was given")
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            if completion.finish_reason == "stop":
                if tokens and tokens[-1] in gen["stop_ids"]:
                    tokens = tokens[:-1]
            elif completion.finish_reason != "length":
                raise RuntimeError(f"vLLM finished request {output.request_id} with {completion.finish_reason!r}")
            answers.append({"token_ids": tokens, "finish_reason": completion.finish_reason})
        if progress is not None:
            progress(len(requests))
        return answers

    def close(self):
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
