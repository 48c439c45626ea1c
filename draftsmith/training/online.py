"""Online hidden states: the target runs on each training batch as it is loaded (draftsmith.training.sources).

The DataLoader hands `__getitems__` a whole packed batch of sample keys; their states come from the hf extraction
backend's extractor on the training device, in right-padded forward batches under `batch_tokens` / `max_batch_size`,
and stay on that device: the collated batch's states are already where the draft trains (pin_memory is off for this
source). The loader runs this in a thread, batches ahead of the step (draftsmith.training.prefetch).

Extraction sorts the whole dataset by length, so its neighbours in a forward batch have about the same length. A
packed training batch mixes lengths (short answers fill the space the long ones leave), and one forward over it
would be mostly padding: `plan_forwards` splits it, sorted by length, into the forwards that cost the fewest padded
tokens, each forward also paying a fixed cost (its launches, every weight read once) in tokens' worth.
"""

from __future__ import annotations

import numpy as np
import torch

from draftsmith.extraction.hf_backend import HFHiddenStateExtractor
from draftsmith.target_model.spec import TargetSpec

FORWARD_COST_TOKENS = 2048  # a forward's fixed cost in padded tokens: a split must save more padding than this


def plan_forwards(lengths: list[int], batch_tokens: int, max_batch_size: int,
                  forward_cost: int = FORWARD_COST_TOKENS) -> list[list[int]]:
    """Indices of `lengths` in forward batches, longest first, that minimise the padded tokens (rows x longest) plus
    `forward_cost` a forward, with rows x longest <= batch_tokens (a longer sample alone) and rows <= max_batch_size.
    Deterministic (ties by index): the same batch always runs in the same forwards."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    longest = np.array([lengths[i] for i in order], dtype=np.int64)
    n = len(order)
    best = np.zeros(n + 1, dtype=np.int64)  # best[i]: the cheapest plan of order[:i]
    cut = np.zeros(n + 1, dtype=np.int64)  # where the plan of order[:i] starts its last forward
    for i in range(1, n + 1):
        starts = np.arange(max(0, i - max_batch_size), i)
        rows = i - starts
        fits = (rows * longest[starts] <= batch_tokens) | (rows == 1)
        cost = np.where(fits, best[starts] + rows * longest[starts] + forward_cost, np.iinfo(np.int64).max)
        j = int(np.argmin(cost))
        best[i], cut[i] = cost[j], starts[j]
    groups, i = [], n
    while i > 0:
        groups.append(order[cut[i]:i])
        i = int(cut[i])
    return groups[::-1]


class TargetOnDevice:
    """The target's extractor, loaded once, with the first batch that needs it (not when a loader is built), and
    shared by the training and validation datasets: one copy of the target's weights on the device."""

    def __init__(self, target: TargetSpec, aux_layer_ids: list[int], device, dtype: str):
        self.target, self.aux_layer_ids, self.device, self.dtype = target, aux_layer_ids, torch.device(device), dtype
        self._extractor = None

    def get(self) -> HFHiddenStateExtractor:
        if self._extractor is None:
            with torch.random.fork_rng(devices=[]):  # loading draws nothing from training's random numbers
                self._extractor = HFHiddenStateExtractor(self.target, self.aux_layer_ids, str(self.device), self.dtype)
        return self._extractor


class OnlineStatesDataset(torch.utils.data.Dataset):
    """Prepared samples whose hidden states the target computes when their batch is loaded.

    Item `i` is sample `indices[i]` of `samples` (the split's keys); the loader asks for `i`, or for `(epoch, i)` where
    the noise is keyed by sample (draftsmith.training.loader), as it asks the offline dataset."""

    def __init__(self, samples, indices: list[int], settings: dict, target: TargetOnDevice, noise):
        self.samples, self.indices, self.settings = samples, indices, settings
        self.target, self.noise = target, noise

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list) -> list[dict]:
        indices = [self.indices[key[1] if isinstance(key, tuple) else key] for key in keys]
        ids = [self.samples.input_ids(i).tolist() for i in indices]
        states: list = [None] * len(keys)
        for group in plan_forwards([len(x) for x in ids], self.settings["batch_tokens"], self.settings["max_batch_size"]):
            for position, sample_states in zip(group, self.target.get().batch_states([ids[p] for p in group]), strict=True):
                states[position] = sample_states
        return [self.sample(key, index, sample_states) for key, index, sample_states in zip(keys, indices, states, strict=True)]

    def sample(self, key, index: int, states: torch.Tensor) -> dict:
        """One sample as speculators' Eagle3SampleFileDataset makes it from a shard file (see the sources module)."""
        from speculators.train.data import shift_batch, standardize_data_v1

        data = standardize_data_v1({"input_ids": torch.from_numpy(self.samples.input_ids(index).copy()),
                                    "loss_mask": torch.from_numpy(self.samples.loss_mask(index).copy()),
                                    "hidden_states": list(states.unbind(0))})
        data = {k: v.to(torch.float) if "hidden_states" in k else v for k, v in data.items()}
        length = data["input_ids"].shape[0]
        data["lengths"] = torch.tensor([length], dtype=torch.long)
        data["position_ids"] = torch.arange(length, dtype=torch.long)
        if self.noise is not None and isinstance(key, tuple):
            self.noise.key = key
            try:
                data = self.noise(data)
            finally:
                self.noise.key = None
        return shift_batch(data)
