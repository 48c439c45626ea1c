"""Where an output leaves target-only greedy decoding's, and by how much: the offline benchmark sizes each mismatch
(the target's logit gap between its token and the emitted one there), so that a near-tie that a low-precision dtype can
flip is told apart from a decoding error.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.target import TargetModel


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    """The first position where `tokens` differs from `reference` (None: neither leaves the other)."""
    for i, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return i
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


@torch.inference_mode()
def divergence_gap(target: TargetModel, prompt_ids: list[int], tokens: list[int], reference: list[int]) -> dict | None:
    """Where a speculative output first leaves the greedy `reference`: its position, both tokens, and the target's
    logit of the greedy token minus that of the emitted one, from one forward over the prompt and the shared prefix.
    A gap near 0 is a near-tie that rounding in a low-precision dtype can flip; a large one is a decoding error."""
    i = first_divergence(tokens, reference)
    if i is None or i >= len(tokens) or i >= len(reference):
        return None if i is None else {"position": i, "greedy_token": None, "emitted_token": None, "logit_gap": None}
    context = list(prompt_ids) + reference[:i]
    logits, _ = target.start(context)
    row = logits[-1].float()
    return {"position": i, "greedy_token": reference[i], "emitted_token": tokens[i],
            "logit_gap": float(row[reference[i]] - row[tokens[i]])}
