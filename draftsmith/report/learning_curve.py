"""The learning curve as data: per variant, how much it trained on, what its validation accuracies predict, and what the
benchmark measured.

One row per variant (sorted by training tokens): `data_fraction`, `train_samples` and `train_tokens`
(training_data.json), `val_full_acc_i` per TTT step (the last validation row of metrics.csv: speculators' cumulative
full accuracies), `predicted_acceptance_length` (1 + val_full_acc_0 + ... + val_full_acc_(k-1) for the benchmark's
chain of k draft tokens, draftsmith.training.acceptance), and from the benchmark's summary.json the trained draft's
`acceptance_length` (tokens per target forward), `tokens_per_drafted_round` (the measured counterpart of the
prediction) and `speedup` over target-only greedy (with its range over the timed runs). The report shows it as its
learning-curve table and writes it as `learning_curve.csv`; `python -m perf learning_curve` writes it from a results tree.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from draftsmith.io import atomic_path
from draftsmith.report.load import ReportInputError, load_metrics, load_summaries, load_training_data
from draftsmith.report.methods import TRAINED_DRAFT as DRAFT
from draftsmith.report.tables import training_table
from draftsmith.training.acceptance import PREDICTED, predicted_acceptance_length

ACC = "val full acc "  # draftsmith.report.tables.training_table's columns of the last validation row
HEAD = ["variant", "datasets", "data_fraction", "train_samples", "train_tokens"]
TAIL = [PREDICTED, "acceptance_length", "tokens_per_drafted_round", "speedup", "speedup_low", "speedup_high",
        "num_speculative_tokens", "backend"]
# the report's names for the CSV's columns (verdict.py and figures.py read the report's table by these names)
SHOWN = {"data_fraction": "data fraction", "train_samples": "train samples", "train_tokens": "train tokens",
         PREDICTED: "predicted acceptance length", "acceptance_length": "acceptance length",
         "tokens_per_drafted_round": "tokens per drafted round", "speedup": "speedup"}
SHOWN_ACC = "val full acc per TTT step"


def _known(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def learning_curve(training_data: pd.DataFrame, training: pd.DataFrame, methods: pd.DataFrame,
                   summaries: dict) -> pd.DataFrame:
    """The curve from the report's loaded inputs: `training_data` (load.load_training_data), `training`
    (tables.training_table), `methods` and `summaries` (load.load_summaries)."""
    steps = sorted(int(c[len(ACC):]) for c in training.columns if c.startswith(ACC))
    acc_cols = [f"val_full_acc_{i}" for i in steps]
    val = training.set_index("variant") if len(training) else pd.DataFrame()
    draft = methods[methods["method"] == DRAFT].set_index("variant")
    rows = []
    for r in training_data.sort_values(["train_tokens", "variant"]).to_dict("records"):
        variant = r["variant"]
        accs = [val.loc[variant, f"{ACC}{i}"] if variant in val.index else None for i in steps]
        accs = [float(a) if _known(a) else math.nan for a in accs]
        d = draft.loc[variant].to_dict() if variant in draft.index else {}
        k = (summaries.get(variant) or {}).get("num_speculative_tokens") or len(d.get("per_position_acceptance") or [])
        rows.append({
            **{c: r[c] for c in HEAD},
            **dict(zip(acc_cols, accs)),
            PREDICTED: predicted_acceptance_length(accs, k or None),
            "acceptance_length": d.get("acceptance_length"),
            "tokens_per_drafted_round": d.get("tokens_per_drafted_round"),
            "speedup": d.get("speedup"),
            "speedup_low": d.get("speedup_low"),
            "speedup_high": d.get("speedup_high"),
            "num_speculative_tokens": k or None,
            "backend": (summaries.get(variant) or {}).get("backend"),
        })
    return pd.DataFrame(rows, columns=HEAD + acc_cols + TAIL)


def report_table(curve: pd.DataFrame) -> pd.DataFrame:
    """The report's learning-curve table: the curve with readable names, the accuracies in one column."""
    acc_cols = [c for c in curve.columns if c.startswith("val_full_acc_")]
    shown = curve[["variant", "datasets", "data_fraction", "train_samples", "train_tokens"]].rename(columns=SHOWN)
    shown[SHOWN_ACC] = [[a for a in accs if _known(a)] or None for accs in curve[acc_cols].itertuples(index=False)]
    for column in (PREDICTED, "acceptance_length", "tokens_per_drafted_round", "speedup"):
        shown[SHOWN[column]] = curve[column]
    return shown


def write_csv(curve: pd.DataFrame, path) -> None:
    with atomic_path(path, suffix=".csv") as tmp:
        curve.to_csv(tmp, index=False)


def from_results(results) -> pd.DataFrame:
    """The curve of a results tree: every variant with a benchmark summary (`benchmark/{variant}/summary.json`), its
    draft's metrics.csv and training_data.json."""
    results = Path(results)
    summaries = sorted(results.glob("benchmark/*/summary.json"))
    if not summaries:
        raise ReportInputError(f"{results}: no benchmark/*/summary.json")
    drafts = [results / "draft" / s.parent.name for s in summaries]
    missing = [str(d / f) for d in drafts for f in ("metrics.csv", "training_data.json") if not (d / f).exists()]
    if missing:
        raise ReportInputError(f"missing draft file(s) of benchmarked variants: {', '.join(missing)}")
    by_variant, methods = load_summaries(summaries)
    training = training_table(load_metrics([d / "metrics.csv" for d in drafts]))
    return learning_curve(load_training_data([d / "training_data.json" for d in drafts]), training, methods,
                          by_variant)
