"""The `vllm` extraction backend: speculators' VllmHiddenStatesGenerator, fixed for vLLM 0.16.

`VllmBackend` is the driver's view of it (see draftsmith.extraction.driver).

`FixedVllmHiddenStatesGenerator` keeps speculators' interface (`generate(token_ids)` returns one
dict per sequence with `input_ids` and `hidden_states`) and replaces each method that breaks on
the installed vLLM with one that goes through `draftsmith.vllm_stack.compat` (see docs/VLLM.md).

The worker side, `CaptureWorkerExtension`, is mixed into every vLLM GPU worker. It wraps the
decoder's own forward (located inside multimodal wrappers too) and hooks the auxiliary decoder
layers, so it records what vLLM itself computes: the state entering decoder layer i
(`hidden_states + residual`, as vLLM's EAGLE-3 serving path forms it) and the decoder's output
after the final norm. Each step's rows are cut per request with the model runner's batch layout
and recorded with the request id, the position of the chunk and the token ids the model saw; the
driver pairs chunks with samples by request id and checks the echoed token ids.

Importing this module imports vLLM (through speculators.data_generation).
"""

from __future__ import annotations

import inspect
import logging

import torch
from speculators.data_generation.vllm_hidden_states_generator import VLLM_BLOCK_SIZE, VllmHiddenStatesGenerator
from transformers import AutoConfig, AutoTokenizer
from vllm.config import CacheConfig, DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import (
    _get_kv_cache_groups_uniform_spec,
    get_kv_cache_config_from_groups,
    unify_hybrid_kv_cache_specs,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.executor.multiproc_executor import MultiprocExecutor
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from draftsmith.devices import gpu_name
from draftsmith.provenance import device_description
from draftsmith.target_model.layers import resolve_aux_layer_ids, text_config
from draftsmith.target_model.remote_code import remote_code_checked
from draftsmith.target_model.spec import TargetSpec
from draftsmith.vllm_stack import compat

log = logging.getLogger(__name__)

WORKER_EXTENSION = "draftsmith.extraction.vllm_backend.CaptureWorkerExtension"
DEFAULT_BATCH_SIZE = 32
MIN_BATCHED_TOKENS = 8192


class CaptureError(RuntimeError):
    """Captured states that do not belong to the sample they were paired with."""


# ----------------------------------------------------------------------------- worker side


class CaptureWorkerExtension:
    """Methods added to vLLM's GPU worker for hidden-state capture (called through collective_rpc)."""

    def draftsmith_setup_capture(self, aux_layer_ids: list[int]) -> str:
        from vllm.distributed import get_tp_group

        model = self.model_runner.model  # type: ignore[attr-defined]
        decoder = compat.locate_decoder(model)
        self._ds_aux = list(aux_layer_ids)
        self._ds_armed = False
        self._ds_step: dict | None = None
        self._ds_chunks: list[dict] = []
        if get_tp_group().rank_in_group != 0:  # every TP rank holds the same states; rank 0 records them
            return type(decoder).__name__
        for layer_id in self._ds_aux:
            layer = decoder.layers[layer_id]
            names = list(inspect.signature(layer.forward).parameters)
            layer.register_forward_pre_hook(self._ds_layer_input_hook(layer_id, names), with_kwargs=True)
        original_forward = decoder.forward

        def forward_with_capture(*args, **kwargs):  # instance attribute: the model's own forward runs unchanged
            self._ds_begin_step()
            output = original_forward(*args, **kwargs)
            self._ds_end_step(output)
            return output

        decoder.forward = forward_with_capture
        return type(decoder).__name__

    def _ds_layer_input_hook(self, layer_id: int, names: list[str]):
        def hook(_module, args, kwargs):
            if self._ds_step is None:
                return
            bound = dict(zip(names, args)) | kwargs
            hidden, residual = bound["hidden_states"], bound.get("residual")
            # a new tensor now: the layer's fused add-norm updates hidden_states and residual in place
            state = hidden.clone() if residual is None else hidden + residual
            self._ds_step["states"][layer_id] = state[: self._ds_step["num_tokens"]]

        return hook

    def _ds_begin_step(self):
        runner = self.model_runner  # type: ignore[attr-defined]
        num_reqs = runner.input_batch.num_reqs if self._ds_armed else 0
        if num_reqs == 0:  # not armed, or a dummy/profiling run
            self._ds_step = None
            return
        bounds = runner.query_start_loc.np[: num_reqs + 1].tolist()
        self._ds_step = {
            "req_ids": list(runner.input_batch.req_ids[:num_reqs]),
            "bounds": bounds,
            "starts": runner.input_batch.num_computed_tokens_cpu[:num_reqs].tolist(),
            "token_ids": runner.input_ids.cpu[: bounds[-1]].clone(),
            "num_tokens": bounds[-1],
            "states": {},
        }

    def _ds_end_step(self, output):
        step, self._ds_step = self._ds_step, None
        if step is None:
            return
        final = output[0] if isinstance(output, tuple) else output
        layers = [step["states"][i] for i in self._ds_aux] + [final[: step["num_tokens"]]]
        layers = [t.to("cpu") for t in layers]
        for row, req_id in enumerate(step["req_ids"]):
            lo, hi = step["bounds"][row], step["bounds"][row + 1]
            if hi > lo:
                self._ds_chunks.append({"request_id": req_id, "start": step["starts"][row],
                                        "token_ids": step["token_ids"][lo:hi],
                                        "hidden_states": [t[lo:hi] for t in layers]})

    def draftsmith_begin_capture(self) -> None:
        self._ds_chunks, self._ds_armed = [], True

    def draftsmith_take_capture(self) -> list[dict]:
        chunks, self._ds_chunks, self._ds_armed = self._ds_chunks, [], False
        return chunks


# ----------------------------------------------------------------------------- pairing


def pair_chunks(request_ids: list[str], batch: list[list[int]], chunks) -> list[dict]:
    """Assemble captured chunks into one result per sequence, in the order of `batch`."""
    if not isinstance(chunks, list) or any(not isinstance(c, dict) for c in chunks):
        kind = type(chunks).__name__ if not isinstance(chunks, list) else f"list of {type(chunks[0]).__name__}"
        raise CaptureError(f"capture reply is a {kind}, expected a list of chunk dicts "
                           "(collective_rpc's reply unwrapped the wrong way?)")
    if not compat.active("request_id_pairing"):
        return _pair_by_position(batch, chunks)
    by_request: dict[str, list[dict]] = {rid: [] for rid in request_ids}
    for chunk in chunks:
        if chunk["request_id"] not in by_request:
            raise CaptureError(f"captured states for request {chunk['request_id']!r}, which is not in this batch")
        by_request[chunk["request_id"]].append(chunk)
    results = []
    for i, (rid, ids) in enumerate(zip(request_ids, batch)):
        parts = sorted(by_request[rid], key=lambda c: c["start"])
        where = f"sequence {i} of the batch (request {rid!r}, {len(ids)} tokens)"
        expected_start = 0
        for part in parts:
            if part["start"] != expected_start:
                raise CaptureError(f"{where}: chunk at position {part['start']}, expected {expected_start} (lost or repeated prefill chunk)")
            expected_start += len(part["token_ids"])
        if expected_start != len(ids):
            raise CaptureError(f"{where}: captured {expected_start} of {len(ids)} tokens (prefill cut short)")
        token_ids = torch.cat([p["token_ids"] for p in parts]).to(torch.long)
        if token_ids.tolist() != list(ids):
            bad = next(j for j, (a, b) in enumerate(zip(token_ids.tolist(), ids)) if a != b)
            raise CaptureError(f"{where}: token id at position {bad} is {token_ids[bad].item()}, the input has {ids[bad]}")
        states = [torch.cat([p["hidden_states"][k] for p in parts]) for k in range(len(parts[0]["hidden_states"]))]
        results.append({"input_ids": token_ids, "hidden_states": states, "loss_mask": None})
    return results


def _pair_by_position(batch: list[list[int]], chunks: list[dict]) -> list[dict]:
    """speculators 0.3.0: concatenate everything captured and cut it by input order and length."""
    token_ids = torch.cat([c["token_ids"] for c in chunks]).to(torch.long)
    layers = [torch.cat([c["hidden_states"][k] for c in chunks]) for k in range(len(chunks[0]["hidden_states"]))]
    results, offset = [], 0
    for ids in batch:
        results.append({"input_ids": token_ids[offset: offset + len(ids)],
                        "hidden_states": [h[offset: offset + len(ids)].clone() for h in layers], "loss_mask": None})
        offset += len(ids)
    return results


# ----------------------------------------------------------------------------- driver side


def build_vllm_config(model_path: str, max_model_len: int, gpu_memory_utilization: float = 0.8,
                      tensor_parallel_size: int = 1, trust_remote_code: bool = False, revision: str | None = None,
                      max_num_seqs: int = DEFAULT_BATCH_SIZE, dtype: str = "auto", device: str = "auto",
                      max_num_batched_tokens: int | None = None) -> VllmConfig:
    """The VllmConfig of the generator: eager (so the capture hooks run), our worker extension, the fixes."""
    model_config = ModelConfig(model=model_path, tokenizer=model_path,
                               trust_remote_code=compat.model_trust_remote_code(trust_remote_code),
                               revision=revision, tokenizer_revision=revision, dtype=dtype,
                               max_model_len=max_model_len, enforce_eager=True)
    batched = max_num_batched_tokens or max(MIN_BATCHED_TOKENS, max_model_len)
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(**compat.cache_config_kwargs(VLLM_BLOCK_SIZE, gpu_memory_utilization)),
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size, worker_extension_cls=WORKER_EXTENSION),
        scheduler_config=SchedulerConfig(**compat.scheduler_config_kwargs(max_model_len, max_num_seqs, batched,
                                                                          model_config.is_encoder_decoder)),
        device_config=DeviceConfig(device=device),
        load_config=LoadConfig(),
    )


class FixedVllmHiddenStatesGenerator(VllmHiddenStatesGenerator):
    """speculators' generator with each method that breaks on the installed vLLM replaced (see vllm_compat)."""

    def __init__(self, model_path, aux_layer_ids, max_model_len, gpu_memory_utilization=0.8, tensor_parallel_size=1,
                 trust_remote_code=False, revision=None, max_num_seqs=DEFAULT_BATCH_SIZE, dtype="auto",
                 device="auto", max_num_batched_tokens=None, executor_class=None):
        # speculators' __init__ is not called: every step of it needs a fix on vLLM 0.16.
        self.model_path = model_path
        self.tensor_parallel_size = tensor_parallel_size
        self._request_counter = 0
        with remote_code_checked(model_path, trust_remote_code):
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, **compat.tokenizer_kwargs(trust_remote_code, revision))
            config = text_config(AutoConfig.from_pretrained(
                model_path, revision=revision, trust_remote_code=compat.model_trust_remote_code(trust_remote_code)))
        self.hidden_size = config.hidden_size
        self.layer_ids = resolve_aux_layer_ids(aux_layer_ids, config.num_hidden_layers)
        self.vllm_config = build_vllm_config(model_path, max_model_len, gpu_memory_utilization, tensor_parallel_size,
                                             trust_remote_code, revision, max_num_seqs, dtype, device,
                                             max_num_batched_tokens)
        log.info("starting the vLLM executor for %s (tensor parallel %d)", model_path, tensor_parallel_size)
        self.executor = (executor_class or MultiprocExecutor)(vllm_config=self.vllm_config)
        self._setup_capture()
        kv_cache_spec = self.executor.collective_rpc("get_kv_cache_spec")[0]
        unify_hybrid_kv_cache_specs(kv_cache_spec)
        kv_cache_groups = _get_kv_cache_groups_uniform_spec(kv_cache_spec)
        available = min(self.executor.determine_available_memory())
        kv_cache_config = get_kv_cache_config_from_groups(
            **compat.kv_cache_config_kwargs(self.vllm_config, kv_cache_groups, kv_cache_spec, available))
        self.vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        self.scheduler = Scheduler(**compat.scheduler_kwargs(
            self.vllm_config, kv_cache_config, StructuredOutputManager(vllm_config=self.vllm_config)))
        self.executor.initialize_from_config([kv_cache_config] * tensor_parallel_size)
        log.info("KV cache: %d blocks of %d tokens", kv_cache_config.num_blocks, self.vllm_config.cache_config.block_size)

    def _setup_capture(self):
        decoder = self.executor.collective_rpc("draftsmith_setup_capture", args=(self.layer_ids,))
        log.info("capturing the inputs of layers %s and the final norm output of %s", self.layer_ids, decoder[0])

    def generate(self, token_ids):
        """States of each sequence: {"input_ids" (as the model saw them), "hidden_states" (4 tensors)}."""
        batch = [ids.tolist() if isinstance(ids, torch.Tensor) else list(ids) for ids in token_ids]
        if not batch:
            raise ValueError("token_ids cannot be empty")
        limit = self.vllm_config.model_config.max_model_len - 1  # one sampled token must fit
        too_long = [i for i, ids in enumerate(batch) if len(ids) > limit]
        if too_long:
            raise ValueError(f"sequences {too_long[:5]} are longer than max_model_len - 1 = {limit}; raise extraction.max_model_len")
        request_ids = [f"req_{self._request_counter}_{i}" for i in range(len(batch))]  # speculators' ids; pairing ignores their order
        self._request_counter += 1
        self.executor.collective_rpc("draftsmith_begin_capture")
        for rid, ids in zip(request_ids, batch):
            self.scheduler.add_request(Request(request_id=rid, prompt_token_ids=ids,
                                               sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                                               pooling_params=None, eos_token_id=self.tokenizer.eos_token_id,
                                               arrival_time=0.0))
        while self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if scheduler_output.total_num_scheduled_tokens == 0:
                raise RuntimeError(f"the scheduler could not schedule {self.scheduler.get_num_unfinished_requests()} "
                                   "requests: the KV cache is too small; raise gpu_memory_utilization or lower batch_size")
            compat.step(self.executor, self.scheduler, scheduler_output)
        chunks = compat.rpc_rank0(self.executor, "draftsmith_take_capture")
        return pair_chunks(request_ids, batch, chunks)


# ----------------------------------------------------------------------------- the driver's backend


class VllmBackend:
    """Batches of `batch_size` samples in shard order, each one scheduler run of the fixed generator."""

    name = "vllm"

    def __init__(self, target: TargetSpec, aux_layer_ids: list[int], cfg: dict, generator=None):
        self.target, self.aux_layer_ids, self.generator = target, list(aux_layer_ids), generator
        self.max_model_len = cfg["max_model_len"]
        self.settings = {"tensor_parallel_size": cfg["tensor_parallel_size"],
                         "gpu_memory_utilization": cfg["gpu_memory_utilization"],
                         "max_model_len": cfg["max_model_len"], "batch_size": cfg["batch_size"],
                         "dtype": target.stage_dtype(cfg["dtype"]),
                         "fixes_applied": [f["name"] for f in compat.fix_report() if f["applied"]]}

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        longest = max(lengths)
        if self.max_model_len is None:  # the shard's longest sample, plus the one token vLLM samples
            self.max_model_len = self.settings["max_model_len"] = longest + 1
        if longest + 1 > self.max_model_len:
            raise ValueError(f"a sample of this shard has {longest} tokens; extraction.max_model_len={self.max_model_len} "
                             "must be at least one more")
        size = self.settings["batch_size"]
        return [list(range(k, min(k + size, len(lengths)))) for k in range(0, len(lengths), size)]

    def extract(self, batches, token_ids, on_sample, progress):
        if self.generator is None:
            s = self.settings
            self.generator = FixedVllmHiddenStatesGenerator(
                self.target.model, self.aux_layer_ids, self.max_model_len, s["gpu_memory_utilization"],
                s["tensor_parallel_size"], self.target.trust_remote_code, self.target.revision, s["batch_size"],
                s["dtype"])
        for batch in batches:
            results = self.generator.generate([token_ids[i] for i in batch])
            if len(results) != len(batch):
                raise CaptureError(f"the generator returned {len(results)} results for {len(batch)} samples")
            for index, result in zip(batch, results):
                on_sample(index, result["input_ids"].tolist(), lambda r=result: r["hidden_states"])
            progress(sum(len(token_ids[i]) for i in batch))

    def device(self) -> str:
        if torch.cuda.is_available():
            return f"cuda: {gpu_name() or torch.cuda.get_device_name(0)} x{self.settings['tensor_parallel_size']} (vLLM tensor parallel)"
        return device_description(torch.device("cpu"))

    def close(self):
        self.generator = None
