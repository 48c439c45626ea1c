"""The training data: the validation split, the `data_fraction` of the rest, and speculators' packing loader over the
samples of a hidden-state source (draftsmith.training.sources: shards, or the target online), with the noise on the
auxiliary states drawn per sample from a generator seeded by (seed, epoch, sample index), so that
a resumed run adds the same noise as an uninterrupted one whatever the worker count."""

from __future__ import annotations

import hashlib
import random

import torch

from draftsmith.training.prefetch import PrefetchingLoader
from draftsmith.training.sources import ShardStates, states_source


def split_train_val(files: list[str], lengths: list[int], val_fraction: float, seed: int):
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    n_val = int(round(val_fraction * len(files))) if len(files) > 1 else 0
    n_val = min(max(n_val, 1 if val_fraction > 0 and len(files) > 1 else 0), len(files) - 1)
    val, train = sorted(order[:n_val]), sorted(order[n_val:])
    return ([files[i] for i in train], [lengths[i] for i in train]), ([files[i] for i in val], [lengths[i] for i in val])


def training_split(source, cfg: dict):
    """(source, (train keys, lengths), (val keys, lengths)) of a hidden-state source (or a list of shard manifests):
    the validation split first, then a seeded `data_fraction` of the rest, so that variants at several fractions are
    validated on the same samples."""
    source = states_source(source)
    keys, lengths = source.keys_and_lengths()
    (train_keys, train_lengths), val = split_train_val(keys, lengths, cfg["val_fraction"], cfg["seed"])
    if cfg["data_fraction"] < 1:
        n = max(1, round(cfg["data_fraction"] * len(train_keys)))
        keep = sorted(random.Random(f"{cfg['seed']}:data_fraction").sample(range(len(train_keys)), n))
        train_keys, train_lengths = [train_keys[i] for i in keep], [train_lengths[i] for i in keep]
    return source, (train_keys, train_lengths), val


def noise_seed(seed: int, epoch: int, index: int) -> int:
    digest = hashlib.sha256(f"draftsmith-noise:{seed}:{epoch}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class SampleSeededNoise:
    """speculators' `AddUniformNoise` (`x + 2 * (U[0, 1) - 0.5) * std` on the named tensors, applied by its dataset
    before the one-token shift) with the random numbers drawn from a generator seeded by (seed, epoch, sample index)
    instead of the process-wide torch generator, so the noise a sample gets in an epoch does not depend on what ran
    before: not on the epochs a resumed run skipped, nor on which DataLoader worker (each with its own generator,
    which cannot be saved) loads it.

    `key` is (epoch, index), set by `SampleKeyedDataset` around each load; with no key (the dataset's own length
    probe at construction) no noise is added."""

    def __init__(self, std: float, seed: int, tensors=("hidden_states",)):
        self.std, self.seed, self.tensors, self.key = std, seed, tensors, None

    def __call__(self, data):
        if self.key is None:
            return data
        generator = None
        for name in self.tensors:
            x = data[name]
            # drawn where the states are: online on the training device (a CPU draw and copy per sample would hold
            # every step up), offline in the CPU loader workers; the same seed gives other numbers on another device
            if generator is None or generator.device != x.device:
                generator = torch.Generator(device=x.device).manual_seed(noise_seed(self.seed, *self.key))
            uniform = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
            data[name] = x + 2 * (uniform - 0.5) * self.std
        return data


class SampleKeyedDataset(torch.utils.data.Dataset):
    """Loads `(epoch, index)` keys from `EpochTaggedBatchSampler`: sets the noise key, then loads sample `index`."""

    def __init__(self, dataset, noise: SampleSeededNoise):
        self.dataset, self.noise = dataset, noise

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        self.noise.key = key
        try:
            return self.dataset[key[1]]
        finally:
            self.noise.key = None


class EpochTaggedBatchSampler(torch.utils.data.Sampler):
    """The batches of speculators' epoch-seeded sampler, each index tagged with the epoch: `[(epoch, index), ...]`."""

    def __init__(self, batch_sampler):
        self.batch_sampler, self.epoch = batch_sampler, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch
        self.batch_sampler.set_epoch(epoch)

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        epoch = self.epoch
        return ([(epoch, int(i)) for i in batch] for batch in self.batch_sampler)


def make_loader(keys, lengths, total_seq_length, noise_std, world_size, rank, seed, num_workers, pin_memory,
                source=None, device="cpu", target=None, prefetch_batches: int | None = None):
    """speculators' packing loader over `keys` of `source` (default: shard files, as `training_split` gives them),
    loaded `prefetch_batches` ahead in a thread (0 loads each batch when the training loop asks for it). By default
    the source's own depth on a GPU and none on a CPU, where the step and the target's forward would share the cores
    (on 2 cores the thread cost online training 13% of its steps)."""
    from speculators.train.data import create_collate_fn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from torch.utils.data import DataLoader

    source = source if source is not None else ShardStates([])
    if not source.num_workers_allowed:
        num_workers, pin_memory = 0, False
    # Noise on the auxiliary inputs only: the targets (last layer) stay the target's exact states.
    noise = SampleSeededNoise(noise_std, seed, tensors=("hidden_states",)) if noise_std > 0 else None
    dataset = source.dataset(keys, total_seq_length, noise, device, target)
    if noise is not None and not source.keys_noise_itself:
        dataset = SampleKeyedDataset(dataset, noise)
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_length,
        lengths=[n - 1 for n in lengths],  # exact lengths (after the one-token shift)
        num_replicas=world_size,
        rank=rank,
        seed=seed,
    )
    if noise is not None:
        sampler = EpochTaggedBatchSampler(sampler)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=create_collate_fn(total_seq_length),
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
    )
    if prefetch_batches is None:
        prefetch_batches = source.prefetch_batches if torch.device(device).type == "cuda" else 0
    return PrefetchingLoader(loader, prefetch_batches, device) if prefetch_batches > 0 else loader
