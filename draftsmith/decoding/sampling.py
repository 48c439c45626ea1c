"""The token choice of batched decoding, on the device and without a host sync: greedy, or seeded sampling.

Rows are independent: a row's tokens depend on its prompt (and for sampling its seed) alone, not on which prompts
share the batch or when it was refilled. Sampling inverts each row's cumulative distribution (temperature, top-k and
top-p applied first) at one uniform number from a counter-based hash of (seed, token index): no sort and no noise
over the vocabulary, whose cost at batch 1024 was three times the model's step (measured on an H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy at temperature 0, else seeded sampling (top_k 0 and top_p 1: off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


# splitmix64's constants as signed 64-bit integers (torch's int64 arithmetic wraps)
_GOLDEN, _MIX1, _MIX2 = -7046029254386353131, -4658895280553007687, -7723592293110705685


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical right shift of int64 (torch's `>>` keeps the sign)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniform_per_row(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One uniform (0, 1) float per row [rows]: splitmix64 of (seed, token index), the same on any device."""
    z = seeds * _GOLDEN + steps * _MIX1 + _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 41).double() + 0.5) / float(1 << 23)  # 23 bits: never 0 or 1


NUCLEUS_BISECTIONS = 24
NUCLEUS_LOG_RANGE = 200.0  # tokens less likely than e^-200 times the top one carry no mass worth a bisection step


def nucleus_threshold(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per row [rows, 1], the log-probability t such that the tokens with log p >= t are the top-p nucleus of
    `logp` (log-probabilities, -inf for tokens cut already): the most likely tokens up to and including the one whose
    mass first exceeds top_p of the row's total. Found by bisection on t in log space rather than a sort of the
    vocabulary, which at a large batch costs more than the model's step. The bracket starts at the level below
    which even all V tokens together hold less than (1 - top_p) of the mass (so the nucleus never reaches below it:
    about 13 nats under the total for top_p 0.9 and 49k tokens), and `NUCLEUS_BISECTIONS` halvings narrow it to
    ~1e-6 nats: tokens closer than that to the boundary token count as tied with it."""
    probs = logp.exp()
    total = probs.sum(-1, keepdim=True)
    target = top_p * total
    high = logp.amax(-1, keepdim=True)
    floor = (total * ((1.0 - top_p) / logp.shape[-1])).log()
    low = torch.maximum(high - NUCLEUS_LOG_RANGE, floor)  # invariant: the mass of log p >= low exceeds the target
    for _ in range(NUCLEUS_BISECTIONS):
        middle = (low + high) / 2
        above = torch.where(logp >= middle, probs, 0.0).sum(-1, keepdim=True) > target
        low = torch.where(above, middle, low)
        high = torch.where(above, high, middle)
    return low


def choose_tokens(logits: torch.Tensor, sampling: Sampling, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The next token of each row [rows] from its logits [rows, vocab]; `steps`: each row's index of that token.

    Sampling: softmax at the temperature, the top-k then top-p cut, then the inverse of the row's cumulative
    distribution (in vocabulary order) at one seeded uniform: an exact draw, one random number per row."""
    if sampling.greedy:
        return logits.argmax(-1)
    logp = (logits.float() / sampling.temperature).log_softmax(-1)
    if sampling.top_k > 0:
        kth = logp.topk(min(sampling.top_k, logp.shape[-1]), dim=-1).values[:, -1:]
        logp = logp.masked_fill(logp < kth, float("-inf"))
    if sampling.top_p < 1.0:
        logp = logp.masked_fill(logp < nucleus_threshold(logp, sampling.top_p), float("-inf"))
    cdf = logp.exp().double().cumsum(-1)
    u = uniform_per_row(seeds, steps)[:, None] * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp(max=logp.shape[-1] - 1)
