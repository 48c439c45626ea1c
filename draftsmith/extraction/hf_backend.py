"""The `hf` extraction backend: a Hugging Face transformers forward pass (CPU or GPU).

Samples are sorted by length and packed into batches under a token budget so little is
padded. The decoder runs without the lm_head; forward hooks capture the inputs of the
auxiliary decoder layers and the output of the final norm. Batches are right-padded and run
without an attention mask: attention is causal, so no real position sees the padding, and
transformers then builds no dense [batch, 1, len, len] mask and SDPA takes its causal kernel.
On a GPU, each sample's states are copied asynchronously into a pinned host tensor of their own
(the padding never leaves the device) and a pool of writer threads serialises and writes the
files while the next batch computes.
"""

from __future__ import annotations

import functools
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from draftsmith.devices import resolve_device, resolve_dtype
from draftsmith.provenance import device_description
from draftsmith.target_model.layers import find_decoder, text_config
from draftsmith.target_model.spec import TargetSpec

log = logging.getLogger(__name__)


def plan_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group sample indices into batches, longest first, so that len(batch) * longest <= batch_tokens.

    Deterministic: the same lengths always give the same batches (resume relies on it).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        new_longest = max(longest, lengths[i])
        if current and (new_longest * (len(current) + 1) > batch_tokens or len(current) >= max_batch_size):
            batches.append(current)
            current, new_longest = [], lengths[i]
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches


@dataclass
class BatchStates:
    """States of one batch on the host: `rows[r]` ([num_layers, length, hidden]) belongs to sample `indices[r]`."""

    indices: list[int]
    rows: list[torch.Tensor]
    owned: bool  # each row its own storage (else views of the batch's, cloned when taken)
    ready: torch.cuda.Event | None = None

    def sample(self, row: int) -> list[torch.Tensor]:
        if self.ready is not None:
            self.ready.synchronize()
        # torch.save writes a tensor's whole storage: a view of the batch would carry every other sample
        states = self.rows[row] if self.owned else self.rows[row].clone()
        return list(states.unbind(0))


class HFHiddenStateExtractor:
    """The target's decoder with hooks that capture the auxiliary layers' inputs and the final norm's output."""

    def __init__(self, target: TargetSpec | str, aux_layer_ids: list[int], device: str = "auto", dtype: str = "auto"):
        target = target if isinstance(target, TargetSpec) else TargetSpec(str(target))
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(target.stage_dtype(dtype), self.device)
        model = target.load_causal_lm(self.dtype)
        self.config = text_config(model.config)
        self.decoder = find_decoder(model).to(self.device).eval()
        del model  # the lm_head is not needed
        self.aux_layer_ids = list(aux_layer_ids)
        self.hidden_size = self.config.hidden_size
        self._captured: dict[str, torch.Tensor] = {}
        self._forward_lock = threading.Lock()  # the hooks write one dict: one forward at a time (loader threads)
        for layer_id in self.aux_layer_ids:
            self.decoder.layers[layer_id].register_forward_pre_hook(self._pre_hook(f"aux{layer_id}"), with_kwargs=True)
        self.decoder.norm.register_forward_hook(self._post_hook("final"))

    def _pre_hook(self, key):
        def hook(_module, args, kwargs):
            self._captured[key] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post_hook(self, key):
        def hook(_module, _args, output):
            self._captured[key] = output

        return hook

    @property
    def layer_keys(self) -> list[str]:
        return [f"aux{i}" for i in self.aux_layer_ids] + ["final"]

    @torch.inference_mode()
    def forward(self, batch_ids: list[list[int]]) -> torch.Tensor:
        """Run one right-padded batch; return states [num_layers, batch, max_len, hidden] on the device."""
        max_len = max(len(ids) for ids in batch_ids)
        input_ids = torch.zeros(len(batch_ids), max_len, dtype=torch.long)
        for row, ids in enumerate(batch_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids)
        with self._forward_lock:
            self._captured.clear()
            # no attention mask: the padding is on the right and attention is causal (see the module docstring)
            self.decoder(input_ids=input_ids.to(self.device, non_blocking=True), use_cache=False)
            return torch.stack([self._captured[k] for k in self.layer_keys])

    def to_host(self, states: torch.Tensor, indices: list[int], lengths: list[int]) -> BatchStates:
        rows = [states[:, row, :n] for row, n in enumerate(lengths)]
        if self.device.type != "cuda":
            return BatchStates(indices, rows, owned=False)
        host = []
        for state in rows:  # torch's caching host allocator reuses the pinned blocks
            host.append(torch.empty(state.shape, dtype=state.dtype, pin_memory=True))
            host[-1].copy_(state, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return BatchStates(indices, host, owned=True, ready=ready)

    def batch_states(self, batch_ids: list[list[int]]) -> list[torch.Tensor]:
        """Each sample's states [num_layers, length, hidden] on the device, as ordinary tensors (copies, outside
        inference mode), which autograd may save: online training feeds them to the draft."""
        states = self.forward(batch_ids)
        return [states[:, row, : len(ids)].clone() for row, ids in enumerate(batch_ids)]

    def sample_states(self, input_ids: list[int]) -> list[torch.Tensor]:
        """States of a single sample (no batching); the reference for tests and the batch-1 benchmark."""
        states = self.forward([input_ids])
        return [s[0].to("cpu") for s in states]


def run_batches(extractor: HFHiddenStateExtractor, samples: list[list[int]], batches: list[list[int]], on_sample, writers: int = 4, progress=None):
    """Extract `batches` of `samples`, calling `on_sample(index, get_states)` from writer threads.

    At most `max_in_flight` batches wait for their writes, which bounds host memory; a write
    error is raised here as soon as it is seen.
    """
    max_in_flight = 3
    in_flight: list[list[Future]] = []

    def finish_oldest():
        for f in in_flight.pop(0):
            f.result()

    with ThreadPoolExecutor(max_workers=writers) as pool:
        for batch in batches:
            lengths = [len(samples[i]) for i in batch]
            states = extractor.forward([samples[i] for i in batch])
            host = extractor.to_host(states, batch, lengths)
            in_flight.append([pool.submit(on_sample, index, functools.partial(host.sample, row)) for row, index in enumerate(batch)])
            while len(in_flight) > max_in_flight or (in_flight and all(f.done() for f in in_flight[0])):
                finish_oldest()
            if progress is not None:
                progress(sum(lengths))
        while in_flight:
            finish_oldest()


class HFBackend:
    """The driver's view of the hf backend (see draftsmith.extraction.driver): batches packed under a token budget."""

    name = "hf"

    def __init__(self, target: TargetSpec, aux_layer_ids: list[int], cfg: dict, extractor: HFHiddenStateExtractor | None = None):
        self.target, self.aux_layer_ids = target, list(aux_layer_ids)
        self.device_name, self.batch_tokens = cfg["device"], cfg["batch_tokens"]
        self.max_batch_size, self.writers = cfg["max_batch_size"], cfg["writer_threads"]
        self._extractor = extractor
        device = resolve_device(self.device_name)
        self.settings = {"dtype": str(resolve_dtype(target.stage_dtype(cfg["dtype"]), device)),
                         "batch_tokens": self.batch_tokens, "max_batch_size": self.max_batch_size}

    @property
    def extractor(self) -> HFHiddenStateExtractor:
        if self._extractor is None:  # loaded only when something is left to extract
            self._extractor = HFHiddenStateExtractor(self.target, self.aux_layer_ids, self.device_name,
                                                     self.settings["dtype"].removeprefix("torch."))
        return self._extractor

    def plan_batches(self, lengths: list[int]) -> list[list[int]]:
        return plan_batches(lengths, self.batch_tokens, self.max_batch_size)

    def extract(self, batches, token_ids, on_sample, progress):
        run_batches(self.extractor, token_ids, batches,
                    lambda index, get_states: on_sample(index, None, get_states), self.writers, progress)

    def device(self) -> str:
        return device_description(resolve_device(self.device_name))

    def close(self):
        self._extractor = None
