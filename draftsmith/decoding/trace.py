"""What one request's decoding did (`Trace`: its tokens, target forwards, drafts proposed and accepted per round, its
times; the benchmark's row fields from it: draftsmith.benchmark.results.trace_counts) and the stopping rule every
decoding loop shares: at most `max_new_tokens` tokens, ending at the first stop token (kept), so that the engine's
outputs and the reference's compare token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trace:
    """What one decoding run did. `proposed[r]`/`accepted[r]`: draft tokens of verification round r."""

    tokens: list[int]
    target_forwards: int
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    first_token_seconds: float | None = None  # from the start to the first token on the host (the prompt's forward)
    # per request under load (draftsmith.decoding.engine.serve): from its admission to its first token, and the
    # time per output token after it; one request alone: the first token's time and the rest's time per token
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None


def cut_output(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The shared stopping rule: at most max_new_tokens, ending at the first stop token (kept)."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
