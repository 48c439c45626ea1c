"""Where training reads the target's hidden states from (`training.hidden_states`).

- offline (`ShardStates`): the shards `extract_hidden_states` wrote; the Dataset is speculators' own file loader.
- online (`OnlineStates`): the prepared samples alone; the target runs on each batch as it is loaded, on the training
  device, with the hf extraction backend's code (`HFHiddenStateExtractor`: the same hooks, dtype and padded batches
  under the same `batch_tokens` / `max_batch_size`), and nothing is written to disk.

Both give the samples in the same order (datasets sorted by name, then by the sample's index in the prepared
samples, whatever the number of shards), so the training split, the data order and the noise are the same for the
same samples. Online, each sample is built from the states as speculators'
`Eagle3SampleFileDataset.__getitem__` builds it from a shard file (its `standardize_data_v1` and `shift_batch`, the
states in float32, `lengths` and `position_ids`), so a batch differs from the offline one only by the rounding of
states computed in other padded batches (tests/test_online_states.py measures it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from draftsmith.artefacts import ONLINE_SETTINGS
from draftsmith.extraction.shards import read_manifest
from draftsmith.io import sha256_file
from draftsmith.provenance import same_model, samples_list_sha256
from draftsmith.target_model.layers import resolve_aux_layer_ids
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.memory import ONLINE_PREFETCH_BATCHES

class TrainingInputError(ValueError):
    """Inputs that cannot train a draft for this target; the message says which and why."""


class ShardStates:
    """Hidden states from shard files (offline)."""

    mode = "offline"
    num_workers_allowed = True
    keys_noise_itself = False  # the loader wraps the dataset in SampleKeyedDataset
    prefetch_batches = 0  # DataLoader workers load ahead

    def __init__(self, manifests: list[str | Path]):
        self.paths = [str(p) for p in manifests]
        self.manifests = [read_manifest(p) for p in self.paths]

    def to_dict(self) -> dict:
        return {"mode": self.mode, "paths": self.paths}

    @property
    def datasets(self) -> list[str]:
        return sorted({Path(m).parent.parent.name for m in self.paths})  # shards/<dataset>/shard_k/manifest.json

    def keys_and_lengths(self) -> tuple[list[str], list[int]]:
        """The sample files by dataset, then by their index in the prepared samples: the order online training has,
        and one that does not depend on how many shards extraction wrote."""
        entries = sorted((Path(path).parent.parent.name, e["index"], str(Path(path).parent / e["file"]), e["num_tokens"])
                         for path, m in zip(self.paths, self.manifests, strict=True) for e in m["samples"])
        return [e[2] for e in entries], [e[3] for e in entries]

    def aux_layer_ids(self, target: TargetSpec) -> list[int]:
        return self.manifests[0]["aux_layer_ids"]

    def check(self, target: TargetSpec, hidden_size: int) -> None:
        if not self.paths:
            raise TrainingInputError("no shard manifests given: nothing to train on")
        fingerprint = target.fingerprint()
        facts = None
        for path, m in zip(self.paths, self.manifests, strict=True):
            mine = {"aux_layer_ids": m["aux_layer_ids"], "hidden_size": m["hidden_size"]}
            if not same_model(m["model"], fingerprint):
                raise TrainingInputError(f"{path}: shard was extracted from a different target model "
                                         f"({m['model'].get('path')}), not {target.model}")
            if facts is None:
                facts = mine
            elif mine != facts:
                raise TrainingInputError(f"{path}: layer set {mine} differs from other shards' {facts}")
            if m["num_samples"] == 0:
                raise TrainingInputError(f"{path}: shard has no samples")
        if facts["hidden_size"] != hidden_size:
            raise TrainingInputError(f"shards have hidden size {facts['hidden_size']}, target has {hidden_size}")

    def fingerprint(self) -> dict:
        """Shards count by their sample list (each file's sha256 and length), not by the whole manifest, whose timing
        fields change when a shard is extracted again to the same bytes."""
        return {"sample_order": "dataset, index",
                "shards": [{"aux_layer_ids": m["aux_layer_ids"], "samples_list_sha256": samples_list_sha256(m)}
                           for m in self.manifests]}

    def dataset(self, keys, total_seq_length: int, noise, device, target: TargetSpec):
        """speculators' own file dataset (the loader keys its noise by sample: draftsmith.training.loader)."""
        from speculators.train.data import Eagle3SampleFileDataset

        return Eagle3SampleFileDataset(max_len=total_seq_length, file_list=list(keys), transform=noise)


class PreparedSamples:
    """The token ids and loss masks of prepared-samples Parquet files, as flat arrays with offsets (a Python list
    per sample would take ~30x the memory at millions of samples)."""

    def __init__(self, paths: list[str | Path]):
        self.ids, self.masks, self.offsets = [], [], [0]
        for path in paths:
            table = pq.read_table(path, columns=["input_ids", "loss_mask"])
            for column, out in (("input_ids", self.ids), ("loss_mask", self.masks)):
                chunks = table.column(column).combine_chunks()
                out.append(np.asarray(chunks.flatten(), dtype=np.int64))
            lengths = np.diff(np.asarray(table.column("input_ids").combine_chunks().offsets))
            self.offsets.extend((self.offsets[-1] + np.cumsum(lengths)).tolist())
        self.ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        self.masks = np.concatenate(self.masks) if self.masks else np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> list[int]:
        return np.diff(self.offsets).tolist()

    def input_ids(self, index: int) -> np.ndarray:
        return self.ids[self.offsets[index]:self.offsets[index + 1]]

    def loss_mask(self, index: int) -> np.ndarray:
        return self.masks[self.offsets[index]:self.offsets[index + 1]]


class OnlineStates:
    """Hidden states the target computes on each batch (online), from the prepared samples."""

    mode = "online"
    num_workers_allowed = False  # the target runs in the loading process, on the training device
    keys_noise_itself = True  # OnlineStatesDataset sets the noise key per sample of a batch
    prefetch_batches = ONLINE_PREFETCH_BATCHES  # the target's forward runs in a thread while the step runs (prefetch.py)

    def __init__(self, samples_paths: list[str | Path], settings: dict):
        self.paths = [str(p) for p in sorted(samples_paths, key=lambda p: Path(p).parent.name)]
        self.settings = {k: settings[k] for k in ONLINE_SETTINGS}
        self.samples = PreparedSamples(self.paths)
        self._target = None

    def to_dict(self) -> dict:
        return {"mode": self.mode, "paths": self.paths, "settings": self.settings}

    @property
    def datasets(self) -> list[str]:
        return [Path(p).parent.name for p in self.paths]  # prepared/<dataset>/samples.parquet

    def keys_and_lengths(self) -> tuple[list[int], list[int]]:
        return list(range(len(self.samples))), self.samples.lengths()

    def aux_layer_ids(self, target: TargetSpec) -> list[int]:
        return resolve_aux_layer_ids(self.settings["aux_layer_ids"], target.load_text_config().num_hidden_layers)

    def check(self, target: TargetSpec, hidden_size: int) -> None:
        if not self.paths:
            raise TrainingInputError("no prepared samples given: nothing to train on")
        if len(self.samples) == 0:
            raise TrainingInputError(f"{', '.join(self.paths)}: no samples")
        try:
            self.aux_layer_ids(target)
        except ValueError as err:
            raise TrainingInputError(f"extraction.aux_layer_ids: {err}") from None

    def fingerprint(self) -> dict:
        return {"samples": [{"dataset": Path(p).parent.name, "sha256": sha256_file(p)} for p in self.paths],
                "online": self.settings}

    def dataset(self, keys, total_seq_length: int, noise, device, target: TargetSpec):
        from draftsmith.training.online import OnlineStatesDataset, TargetOnDevice

        key = (target, str(device))  # TargetSpec is frozen: hashable, equal by its fields
        if self._target is None or self._target[0] != key:  # one target on the device for every loader of a run
            self._target = (key, TargetOnDevice(target, self.aux_layer_ids(target), device, self.settings["dtype"]))
        return OnlineStatesDataset(self.samples, list(keys), self.settings, self._target[1], noise)


def states_source(spec) -> ShardStates | OnlineStates:
    """A source itself, a source from its `to_dict()`, or the offline source from a plain list of manifest paths."""
    if isinstance(spec, ShardStates | OnlineStates):
        return spec
    if isinstance(spec, list | tuple):
        return ShardStates(spec)
    if spec["mode"] == "online":
        return OnlineStates(spec["paths"], spec["settings"])
    return ShardStates(spec["paths"])


def check_source(source, d2t: torch.Tensor, t2d: torch.Tensor, target: TargetSpec) -> None:
    """Check the states, the vocab map and the target fit together."""
    target_config = target.load_text_config()
    source.check(target, target_config.hidden_size)
    if t2d.shape[0] != target_config.vocab_size:
        raise TrainingInputError(f"t2d covers {t2d.shape[0]} tokens but the target vocabulary has {target_config.vocab_size}")
    if int(t2d.sum()) != d2t.shape[0]:
        raise TrainingInputError(f"t2d marks {int(t2d.sum())} tokens but d2t has {d2t.shape[0]} entries")
    if d2t.shape[0] > target_config.vocab_size:
        raise TrainingInputError(f"draft vocabulary {d2t.shape[0]} is larger than the target's {target_config.vocab_size}")
