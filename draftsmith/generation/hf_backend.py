"""The `hf` regenerate backend: a Hugging Face model on the CPU or one GPU.

A full-attention SDPA model (Llama, Qwen, SmolLM2, ...) decodes with the engine of draftsmith.decoding.engine
(`generate`, target-only): `batch_size` rows over a static KV cache, each row refilled with the next prompt as soon as
its answer ends, the decode step replayed as a CUDA graph on a GPU, 16 steps a round read one round late, where each
row's attention reads only its own cache slots (`attention: ragged`, a Triton kernel; `sdpa`: SDPA over the whole
cache through the rows' masks). Sampling there draws from seeded counter-based noise per row (`choose_tokens`).

Any other model (sliding-window attention, ...) goes through transformers' `generate` in left-padded batches:
requests sorted longest first, `batch_size` at a time, left-padded with the pad token (else the first stop token).
Greedy is `generate`'s own greedy search. Sampling draws each row's token with that row's own generator, seeded by
its request (`SeededSampler`): temperature, top-k and top-p as transformers' warpers apply them, then one
multinomial draw per row.

Either way an answer depends on its prompt and seed, not on which other prompts share its batch or chunk.
"""

from __future__ import annotations

import logging

import torch
from transformers import LogitsProcessor

from draftsmith.decoding.batch_target import BatchTarget
from draftsmith.decoding.engine import generate
from draftsmith.decoding.ragged_attention import use_ragged
from draftsmith.decoding.sampling import Sampling
from draftsmith.decoding.static_cache import full_attention_sdpa
from draftsmith.decoding.target import TargetModel
from draftsmith.target_model.spec import TargetSpec

log = logging.getLogger(__name__)

BATCH_DECODER = "draftsmith.decoding.engine v3"
GPU_ROUND_STEPS = 16  # decode steps a round on a GPU, between the host's looks at the rows


def compile_norms_and_mlps(model) -> None:
    """The model's RMSNorm and MLP modules compiled in place (their elementwise kernels fused)."""
    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "MLP")):
            module.compile()


class SeededSampler(LogitsProcessor):
    """A logits processor that samples each row's next token with the row's own torch.Generator and leaves only
    that token possible, so that `generate`'s greedy step picks it. Rows that already finished keep drawing; their
    tokens are discarded by `generate`, and no other row's draws depend on them."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, top_k: int):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.seeds = list(seeds)
        self.generators: list[torch.Generator] | None = None
        # transformers' own warpers, in the order `generate(do_sample=True)` applies them
        warpers = [TemperatureLogitsWarper(temperature)]
        if top_k > 0:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)
        chosen = torch.stack([torch.multinomial(probs[r], 1, generator=g) for r, g in enumerate(self.generators)])
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, chosen, 0.0)


class HFBackend:
    """transformers `generate`; `device` and `dtype` as resolved by the caller ("cpu", "float32", ...)."""

    name = "hf"

    def __init__(self, target: TargetSpec, cfg: dict, model=None):
        self.target = target
        self.device = str(cfg.get("device", "cpu"))
        self.dtype = str(cfg.get("dtype", "float32"))
        self.batch_size = int(cfg.get("batch_size", 16))
        if self.batch_size < 1:
            raise ValueError("regenerate.batch_size must be >= 1")
        self.model = model
        self.engine: BatchTarget | None = None
        # what else determines the answers, beyond the sampling settings (the driver's fingerprint has dtype): the
        # engine samples with its own noise, so its answers are not those of the generate path before it
        self.settings: dict = {"decoder": BATCH_DECODER}
        # on a GPU the engine also compiles the model's RMSNorm and MLP modules (on one H100 at batch 2048: 47.3k
        # vs 43.5k new tokens/s, docs/BENCHMARKS.md); fused kernels round differently, so the answers' fingerprint
        # says so
        self.compile_layers = self.device.startswith("cuda")
        if self.compile_layers:
            self.settings["compiled_layers"] = "RMSNorm, MLP"
        # and its decode steps attend to each row's own slots (`attention: ragged`, a Triton kernel: 111.7k new tokens/s
        # on one H100 at batch 2048, against 49.2k side by side through SDPA over the busy rows' common span, since
        # removed), another rounding of the attention; without Triton, or with `attention: sdpa`, SDPA over the whole
        # cache
        self.ragged = use_ragged(str(cfg.get("attention", "ragged")), torch.device(self.device), "regenerate")
        if self.ragged:
            self.settings["attention"] = "ragged decode (Triton)"

    def prompt_limit(self, lengths: list[int], max_new_tokens: int) -> int | None:
        """No limit of its own: transformers generates past any length (seq_length is the driver's check)."""
        return None

    def generate(self, requests: list[dict], gen: dict, progress=None) -> list[dict]:
        """One answer per request (`prompt_ids`, `seed`), in order: `token_ids` (without the stop token) and
        `finish_reason` (`stop` or `length`). `gen`: max_new_tokens, temperature, top_p, top_k, stop_ids, pad_id."""
        if self.model is None:
            log.info("loading %s (%s, %s) for generate", self.target.model, self.dtype, self.device)
            self.model = self.target.load_causal_lm(getattr(torch, self.dtype)).to(self.device).eval()
        if full_attention_sdpa(self.model):
            return self._generate_batched(requests, gen, progress)
        return self._generate_padded(requests, gen, progress)

    def _generate_batched(self, requests: list[dict], gen: dict, progress=None) -> list[dict]:
        on_gpu = next(self.model.parameters()).device.type == "cuda"
        if self.engine is None:
            if on_gpu and self.compile_layers:
                compile_norms_and_mlps(self.model)
            self.engine = BatchTarget(TargetModel(self.model), cuda_graphs=on_gpu, ragged=on_gpu and self.ragged,
                                      compile_sampler=on_gpu, capture_prefills=False)
        sampling = Sampling(gen["temperature"], gen["top_p"], gen["top_k"])
        answers = generate(self.engine, [r["prompt_ids"] for r in requests], gen["max_new_tokens"], gen["stop_ids"],
                           self.batch_size, sampling, [r["seed"] for r in requests],
                           steps=GPU_ROUND_STEPS if on_gpu else 1, progress=progress)
        return [{"token_ids": tokens, "finish_reason": reason} for tokens, reason in answers]

    def _generate_padded(self, requests: list[dict], gen: dict, progress=None) -> list[dict]:
        """transformers `generate` in left-padded batches (models the engine cannot take)."""
        from transformers import LogitsProcessorList

        model, stops = self.model, sorted(gen["stop_ids"])
        pad = gen["pad_id"]
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i]["prompt_ids"]), i))
        answers: dict[int, dict] = {}
        sampling = gen["temperature"] > 0
        for start in range(0, len(order), self.batch_size):
            rows = order[start: start + self.batch_size]
            width = max(len(requests[i]["prompt_ids"]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                prompt = requests[i]["prompt_ids"]
                ids[r, width - len(prompt):] = torch.tensor(prompt)
                mask[r, width - len(prompt):] = 1
            extra = {}
            if sampling:
                extra["logits_processor"] = LogitsProcessorList([SeededSampler(
                    [requests[i]["seed"] for i in rows], gen["temperature"], gen["top_p"], gen["top_k"])])
            with torch.inference_mode():
                out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                     max_new_tokens=gen["max_new_tokens"], eos_token_id=stops, pad_token_id=pad,
                                     do_sample=False, **extra)
            for r, i in enumerate(rows):
                new = out[r, width:].tolist()
                cut = next((k for k, t in enumerate(new) if t in gen["stop_ids"]), None)
                answers[i] = {"token_ids": new if cut is None else new[:cut],
                              "finish_reason": "length" if cut is None else "stop"}
            if progress is not None:
                progress(len(rows))
        return [answers[i] for i in range(len(requests))]

    def close(self):
        self.model = self.engine = None
