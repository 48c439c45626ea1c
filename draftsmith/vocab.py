"""Token frequencies over loss-masked tokens and the draft vocabulary map (d2t / t2d).

d2t[i] is the offset that maps draft token i to target token `i + d2t[i]`; t2d is a boolean
mask over the target vocabulary marking the tokens the draft can propose. Both follow
speculators' convention and are built with its own function.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from draftsmith.data.tokenization import read_samples
from draftsmith.io import atomic_path


def token_frequencies(samples_path: str | Path) -> dict[int, int]:
    samples = read_samples(samples_path)
    counts: Counter[int] = Counter()
    for ids, mask in zip(samples["input_ids"], samples["loss_mask"]):
        counts.update(t for t, m in zip(ids, mask) if m)
    return dict(sorted(counts.items()))


def combine_frequencies(freqs: list[dict[int, int]]) -> dict[int, int]:
    total: Counter[int] = Counter()
    for f in freqs:
        total.update(f)
    return dict(sorted(total.items()))


def build_vocab_map(freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (d2t int64 [draft_vocab_size], t2d bool [target_vocab_size]); deterministic."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if draft_vocab_size > target_vocab_size:
        raise ValueError(
            f"vocab.draft_vocab_size={draft_vocab_size} is larger than the target's vocabulary ({target_vocab_size})"
        )
    if draft_vocab_size < 1:
        raise ValueError(f"vocab.draft_vocab_size must be >= 1, got {draft_vocab_size}")
    bad = [t for t in freq if not 0 <= t < target_vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the target vocabulary of {target_vocab_size}")
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size, target_vocab_size)
    return d2t.numpy().astype(np.int64), t2d.numpy().astype(bool)


def vocab_coverage(freq: dict[int, int], sizes: list[int]) -> dict[int, float]:
    """The share of the counted (assistant) tokens that a draft vocabulary of each size holds: the most frequent
    `size` tokens, as build_vocab_map picks them. A token outside it can never be drafted, so 1 - coverage caps what
    the draft can accept at each position: the measure to choose vocab.draft_vocab_size by."""
    counts = sorted(freq.values(), reverse=True)
    total = sum(counts) or 1
    return {n: sum(counts[:n]) / total for n in sizes}


def coverage_line(freq: dict[int, int], draft_vocab_size: int, target_vocab_size: int) -> str:
    """What the chosen draft vocabulary covers, beside half and twice its size (where the target has that many)."""
    sizes = [n for n in (draft_vocab_size // 2, draft_vocab_size, 2 * draft_vocab_size) if 1 <= n <= target_vocab_size]
    covered = vocab_coverage(freq, sizes)
    others = ", ".join(f"{n} would cover {100 * covered[n]:.2f}%" for n in sizes if n != draft_vocab_size)
    return (f"draft vocab {draft_vocab_size} of {target_vocab_size} target tokens covers "
            f"{100 * covered[draft_vocab_size]:.2f}% of assistant tokens" + (f" ({others})" if others else ""))


def save_npy(path: str | Path, array: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)  # a file object: np.save would append ".npy" to a path


def load_vocab_map(d2t_path: str | Path, t2d_path: str | Path):
    import torch

    d2t = torch.from_numpy(np.load(d2t_path))
    t2d = torch.from_numpy(np.load(t2d_path))
    return d2t, t2d
