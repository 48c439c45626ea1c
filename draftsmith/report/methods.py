"""The benchmark methods as the report shows them: the methods are those the summaries hold, named here, in one place.

A method the benchmark adds needs nothing here to appear in every table and figure (under its own name until it gets
a display name below); the verdict judges the trained draft against the baseline and every other drafting method."""

from __future__ import annotations

from draftsmith.benchmark.results import BASELINE, METHODS

TRAINED_DRAFT = "eagle3_draft"  # the draft the pipeline trains: the method the verdict and findings judge
PROMPT_LOOKUP = "prompt_lookup"  # the alternative that needs no training
LABELS = {
    BASELINE: "target-only greedy",
    PROMPT_LOOKUP: "prompt lookup",
    "untrained_draft": "untrained draft",
    TRAINED_DRAFT: "trained EAGLE-3 draft",
    "hybrid": "hybrid (prompt lookup, else the draft)",
}


def method_label(method: str) -> str:
    return LABELS.get(method, method)


def method_order(methods) -> list[str]:
    """The methods present, in the benchmark's order (METHODS), then any other in the order they appear."""
    present = list(dict.fromkeys(methods))
    return [m for m in METHODS if m in present] + [m for m in present if m not in METHODS]


def other_drafting(methods) -> list[str]:
    """The drafting methods present other than the trained draft, in the report's order: what it is compared with."""
    return [m for m in method_order(methods) if m not in (BASELINE, TRAINED_DRAFT)]
