"""Offline and vLLM acceptance side by side: with `benchmark.backend: vllm` and `benchmark.offline_reference`, the
offline benchmark of the same draft on the same prompts sits beside the vLLM results
(results/benchmark/{variant}/offline/). In float32 the two should agree exactly: the same greedy verification, the
same draft; this table shows both and counts the prompts whose draft/accept counters are equal."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from draftsmith.benchmark.results import BASELINE, first_size_rows
from draftsmith.io import read_json
from draftsmith.report.load import ReportInputError
from draftsmith.report.methods import method_order
from draftsmith.report.tables import fmt

COUNTERS = ["prompt_tokens", "new_tokens", "target_forwards", "drafts", "draft_tokens", "accepted_tokens"]


def _accept_columns(df: pd.DataFrame) -> list[str]:
    return sorted((c for c in df.columns if c.startswith("accept_pos_")), key=lambda c: int(c.rsplit("_", 1)[1]))


def _load(summary_path) -> tuple[dict, pd.DataFrame]:
    """A summary.json and the per_prompt.csv beside it."""
    path = Path(summary_path)
    try:
        summary = read_json(path)
        per_prompt = first_size_rows(pd.read_csv(path.parent / "per_prompt.csv"))  # a sweep: batch size 1's rows
    except (OSError, ValueError) as e:
        raise ReportInputError(f"{path}: cannot read the benchmark results: {e}") from e
    missing = [c for c in ["variant", "method", "prompt_id", *COUNTERS] if c not in per_prompt.columns]
    if missing or "methods" not in summary:
        raise ReportInputError(f"{path.parent}: missing {', '.join(missing) or 'methods'}")
    return summary, per_prompt


def equal_counter_prompts(vllm: pd.DataFrame, offline: pd.DataFrame, method: str) -> tuple[list[str], list[str]]:
    """Prompt ids of `method` whose counters (tokens, forwards, drafts, accepted per position) are equal in both
    tables, and the prompt ids where they differ (a prompt missing from one table differs)."""
    columns = COUNTERS + [c for c in _accept_columns(vllm) if c in offline.columns]
    a = vllm[vllm["method"] == method].set_index("prompt_id")
    b = offline[offline["method"] == method].set_index("prompt_id")
    equal, differ = [], []
    for pid in sorted(set(a.index) | set(b.index)):
        same = pid in a.index and pid in b.index and all(a.at[pid, c] == b.at[pid, c] for c in columns)
        (equal if same else differ).append(pid)
    return equal, differ


def backends_table(vllm_summaries, reference_summaries) -> pd.DataFrame:
    """One row per variant and speculative method in both runs: acceptance, drafts and accepted tokens from each
    backend, and how many prompts have equal counters."""
    vllm = {s["variant"]: (s, df) for s, df in map(_load, vllm_summaries)}
    rows = []
    for ref_summary, ref_df in map(_load, reference_summaries):
        variant = ref_summary["variant"]
        if variant not in vllm:
            raise ReportInputError(f"offline reference for variant {variant!r} has no vllm benchmark beside it")
        summary, df = vllm[variant]
        for method in [m for m in method_order(summary["methods"]) if m != BASELINE and m in ref_summary["methods"]]:
            on, off = summary["methods"][method], ref_summary["methods"][method]
            equal, differ = equal_counter_prompts(df, ref_df, method)
            total = lambda d, col: float(d.loc[d["method"] == method, col].sum())  # noqa: E731
            rows.append({
                "variant": variant,
                "method": method,
                "acceptance length (offline)": off["acceptance_length"],
                "acceptance length (vLLM)": on["acceptance_length"],
                "per-position acceptance (offline)": off["per_position_acceptance"],
                "per-position acceptance (vLLM)": on["per_position_acceptance"],
                "drafts (offline / vLLM)": [int(total(ref_df, "drafts")), int(total(df, "drafts"))],
                "accepted tokens (offline / vLLM)": [int(total(ref_df, "accepted_tokens")), int(total(df, "accepted_tokens"))],
                "prompts with equal counters": f"{len(equal)} of {len(equal) + len(differ)}",
                "lossless (offline / vLLM)": [off.get("lossless"), on.get("lossless")],
                "devices": f"{ref_summary.get('device')} | {summary.get('device')}",
                "_differ": differ,
            })
    return pd.DataFrame(rows)


def backend_findings(table: pd.DataFrame) -> list[str]:
    lines = []
    for r in table.to_dict("records"):
        agree = r["prompts with equal counters"]
        text = (f"`{r['variant']}` {r['method']}: acceptance length {fmt(r['acceptance length (offline)'])} offline and "
                f"{fmt(r['acceptance length (vLLM)'])} in vLLM; draft/accept counters equal on {agree} prompts")
        if r["_differ"]:
            text += f" (**they differ on {', '.join(map(str, r['_differ'][:5]))}**)"
        lines.append(text + ".")
    return lines
