"""Checks on the target's own answers (rule regenerate): answers are training replies, so they are measured,
not trusted.

Per dataset regenerate's stats get:

- `cut_at_max_new_tokens` / `cut_share`: answers that ended without an end-of-turn token (finish_reason
  `length`: cut at `regenerate.max_new_tokens`, or for the vllm backend at `max_model_len`); a training reply
  cut there teaches the draft an answer that never ends. Most answers cut is warned about.
- `new_tokens_percentiles`: p10 / p50 / p90 of the answers' new tokens (nearest rank; the end-of-turn token
  counts, as in `num_new_tokens`).
- `repetitive_answers` / `repetitive_share`: answers stuck in a loop, by `is_repetitive`: the last
  `REPETITION_WINDOW` (64) generated tokens are one block of at most `REPETITION_MAX_PERIOD` (32) tokens repeated
  back to back (token i equals token i + p across the whole window, so the block repeats at least twice). That
  catches `the the the ...`, `1. 1. 1. ...` and a sentence said over and over, which small or greedy targets fall
  into; an answer shorter than the window is never counted (it ended before a loop could fill it).
"""

from __future__ import annotations

import math

REPETITION_WINDOW = 64
REPETITION_MAX_PERIOD = 32
MOSTLY_CUT = 0.5  # a warning when more than this share of answers is cut


def is_repetitive(tokens, window: int = REPETITION_WINDOW, max_period: int = REPETITION_MAX_PERIOD) -> bool:
    """Whether the last `window` tokens are one block of p <= max_period tokens repeated (see the module doc)."""
    tokens = list(tokens)
    if len(tokens) < window:
        return False
    tail = tokens[-window:]
    periods = range(1, min(max_period, window - 1) + 1)
    return any(all(tail[i] == tail[i + p] for i in range(window - p)) for p in periods)


def nearest_rank(sorted_values: list, q: float):
    """The q-quantile (0 < q <= 1) of values sorted ascending, by nearest rank (a value that occurs)."""
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def answer_stats(rows: list[dict]) -> dict:
    """The checks above over answer rows (`finish_reason`, `num_new_tokens`, `repetitive`)."""
    n = len(rows)
    cut = sum(r["finish_reason"] == "length" for r in rows)
    repetitive = sum(bool(r.get("repetitive")) for r in rows)
    lengths = sorted(r["num_new_tokens"] for r in rows)
    return {
        "cut_at_max_new_tokens": cut,
        "cut_share": round(cut / n, 4) if n else None,
        "new_tokens_percentiles": {f"p{int(q * 100)}": nearest_rank(lengths, q) for q in (0.1, 0.5, 0.9)} if n else {},
        "repetitive_answers": repetitive,
        "repetitive_share": round(repetitive / n, 4) if n else None,
        "repetition_check": {"window": REPETITION_WINDOW, "max_period": REPETITION_MAX_PERIOD},
    }
