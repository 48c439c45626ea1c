"""Prompt lookup's n-grams: the drafts that followed the earliest earlier occurrence of the context's last n tokens
(`prompt_lookup_candidates`, a scan: the definition), and the incremental index the proposers use (`NgramIndex`, one
per context: `ContextNgrams`), tested equal to the scan.
"""

from __future__ import annotations

import numpy as np


def prompt_lookup_candidates(context: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the context's last n tokens,
    trying the longest n (<= max_ngram) first, down to min_ngram; [] when no such n-gram recurs. A scan of the whole
    context: the definition that the proposers' incremental NgramIndex is tested against."""
    tokens = np.asarray(context)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0..length-1-n
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return list(context[start : start + k])
    return []


class NgramIndex:
    """The earliest start of every n-gram (n <= max_ngram) of a growing token sequence: `candidates` answers what
    prompt_lookup_candidates answers on the same tokens, in time of the tokens added since the last call rather than
    a scan of the whole context (at 64 rows a scan a row took milliseconds of host time a round)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.first: list[dict] = [{} for _ in range(max_ngram + 1)]  # n -> {n-gram: its earliest start}

    def extend(self, tokens: list[int]) -> None:
        old = len(self.tokens)
        self.tokens += tokens
        for n in range(1, self.max_ngram + 1):  # the windows that end before the last token, as the scan's
            first, seq = self.first[n], self.tokens
            for start in range(max(0, old - n), len(seq) - n):
                first.setdefault(tuple(seq[start: start + n]), start)

    def candidates(self, k: int, min_ngram: int = 1) -> list[int]:
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq) - 1), min_ngram - 1, -1):
            start = self.first[n].get(tuple(seq[len(seq) - n:]))
            if start is not None:
                return seq[start + n: start + n + k]
        return []


class ContextNgrams:
    """Each slot's NgramIndex (a slot: a batch row, or 0), kept for the context list the slot was last asked about:
    the decoding loops extend a context in place and give a new request a new list, which starts a new index."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self._held: dict[int, tuple[list[int], NgramIndex]] = {}

    def candidates(self, slot: int, context: list[int], k: int, min_ngram: int = 1) -> list[int]:
        held = self._held.get(slot)
        if held is None or held[0] is not context or len(context) < len(held[1].tokens):
            held = self._held[slot] = (context, NgramIndex(self.max_ngram))
        index = held[1]
        index.extend(context[len(index.tokens):])
        return index.candidates(k, min_ngram)
