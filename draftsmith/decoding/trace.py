"""What one request's decoding did (`Trace`: its tokens, target forwards, drafts proposed and accepted per round, its
times) and the stopping rule every decoding loop shares: at most `max_new_tokens` tokens, ending at the first stop
token (kept), so that the engine's outputs and the reference's compare token for token.
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

    def counts(self, k: int) -> dict:
        """Row fields of `draftsmith.benchmark.results` (rounds without a proposal are not drafts)."""
        if any(p > k for p in self.proposed):
            raise ValueError(f"a round proposed more than k={k} draft tokens: {max(self.proposed)}")
        if any(a > p for a, p in zip(self.accepted, self.proposed)):
            raise ValueError("a round accepted more draft tokens than it proposed")
        row = {
            "new_tokens": len(self.tokens),
            "target_forwards": self.target_forwards,
            "drafts": sum(1 for p in self.proposed if p > 0),
            "draft_tokens": sum(self.proposed),
            "accepted_tokens": sum(self.accepted),
            "seconds": self.seconds,
            "first_token_seconds": self.first_token_seconds,
            **self.latency(),
        }
        for i in range(1, k + 1):
            row[f"accept_pos_{i}"] = sum(1 for a in self.accepted if a >= i)
        return row

    def latency(self) -> dict:
        """The request's time to its first token and time per output token after it (alone: its own times)."""
        if self.ttft_seconds is not None:
            return {"ttft_seconds": self.ttft_seconds, "tpot_seconds": self.tpot_seconds}
        first = self.first_token_seconds
        after = (self.seconds - first) / (len(self.tokens) - 1) if first is not None and len(self.tokens) > 1 else None
        return {"ttft_seconds": first, "tpot_seconds": after}


def cut_output(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """The shared stopping rule: at most max_new_tokens, ending at the first stop token (kept)."""
    for i, token in enumerate(tokens[:max_new_tokens]):
        if token in stop_ids:
            return tokens[: i + 1]
    return tokens[:max_new_tokens]


def answer_done(tokens: list[int], new: list[int], max_new_tokens: int, stop_ids: set[int]) -> bool:
    """Whether an answer of `tokens` is over once `new` (its latest tokens) are added: the stopping rule."""
    return len(tokens) >= max_new_tokens or any(t in stop_ids for t in new)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
