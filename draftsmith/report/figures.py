"""The report's seaborn figures, one PNG each."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from tqdm import tqdm  # noqa: E402

from draftsmith.benchmark.results import BASELINE  # noqa: E402
from draftsmith.report.methods import method_label, method_order  # noqa: E402
from draftsmith.report.tables import ttt_steps, variants_in_order  # noqa: E402

log = logging.getLogger(__name__)

FIGURES = {
    "acceptance_length": "Acceptance length (tokens per target forward) by method",
    "per_position_acceptance": "Acceptance rate by draft position",
    "throughput": "Decoding throughput (tokens/s) and speedup over target-only greedy, with its range over the timed runs",
    "speedup_by_batch_size": "Throughput under load: speedup over target-only greedy against concurrency (requests in flight; offline: a row takes the next prompt as its answer ends)",
    "training_loss": "Training loss per TTT step",
    "training_accuracy": "Training accuracy per TTT step",
    "acceptance_by_category": "Acceptance length per prompt category",
    "data_size": "Learning curve: trained-draft acceptance against the amount of training data, measured and as validation predicted",
    "data_stats": "Dataset records and tokens",
}
# Each plot_* function draws its figure, or draws nothing and returns why (a figure with nothing to show is left out of
# the report, a line saying why in its place).

def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def plot_acceptance_length(methods: pd.DataFrame, per_prompt: pd.DataFrame, path: Path) -> None:
    order = method_order(methods["method"])
    variants = variants_in_order(methods)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sns.barplot(methods, x="method", y="acceptance_length", hue="variant", order=order, hue_order=variants,
                errorbar=None, alpha=0.85, ax=ax)
    if len(per_prompt):
        sns.stripplot(per_prompt, x="method", y="acceptance_length", hue="variant", order=order, hue_order=variants,
                      dodge=True, palette={v: "black" for v in variants}, size=3, alpha=0.35, legend=False, ax=ax)
    ax.set_xticks(range(len(order)), [method_label(m) for m in order])
    ax.set(xlabel="", ylabel="tokens per target forward",
           title="Acceptance length (bars: all prompts, dots: single prompts)")
    _save(fig, path)


def per_position_frame(methods: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for r in methods.itertuples():
        for pos, rate in enumerate(r.per_position_acceptance or [], start=1):
            if rate is not None and r.method != BASELINE:
                rows.append({"variant": r.variant, "method": method_label(r.method), "position": pos, "rate": rate})
    return pd.DataFrame(rows, columns=["variant", "method", "position", "rate"])


def plot_per_position(methods: pd.DataFrame, path: Path) -> str | None:
    df = per_position_frame(methods)
    if df.empty:
        return "the benchmark has no drafting method, so no draft position to show"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sns.lineplot(df, x="position", y="rate", hue="method", style="variant", markers=True, errorbar=None, ax=ax)
    ax.set_xticks(sorted(df["position"].unique()))
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1))
    ax.set(ylim=(0, 1.02), xlabel="draft position", ylabel="fraction of drafts accepted up to here",
           title="Per-position acceptance")
    _save(fig, path)


def plot_throughput(methods: pd.DataFrame, path: Path) -> None:
    order = method_order(methods["method"])
    variants = variants_in_order(methods)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sns.barplot(methods, x="method", y="tokens_per_s", hue="variant", order=order, hue_order=variants,
                errorbar=None, ax=ax)
    indexed = methods.set_index(["variant", "method"])
    for variant, container in zip(variants, ax.containers):  # one container per variant, in hue order
        labels = []
        for bar in container:
            method = order[round(bar.get_x() + bar.get_width() / 2)]
            if (variant, method) not in indexed.index or pd.isna(indexed.loc[(variant, method), "speedup"]):
                labels.append("")
                continue
            r = indexed.loc[(variant, method)]
            low, high = r.get("speedup_low"), r.get("speedup_high")
            spread = f"\n{low:.2f}–{high:.2f}" if method != BASELINE and pd.notna(low) and pd.notna(high) else ""
            labels.append(f"{r['speedup']:.2f}×{spread}")
        ax.bar_label(container, labels=labels, fontsize=8, padding=2)
    ax.set_xticks(range(len(order)), [method_label(m) for m in order])
    ax.set(xlabel="", ylabel="generated tokens/s",
           title="Throughput (labels: speedup over target-only greedy; below it, its range over the timed runs)")
    ax.margins(y=0.12)
    _save(fig, path)


def plot_speedup_by_batch_size(batch: pd.DataFrame, path: Path) -> str | None:
    fig = speedup_by_batch_size_figure(batch)
    if fig is None:
        sizes = ", ".join(str(int(s)) for s in sorted(batch["batch_size"].unique())) or "none"
        return (f"one batch size measured per variant ({sizes}), so there is no curve to draw: set "
                f"`benchmark.batch_sizes` (e.g. [1, 4, 16, 64]) to measure the speedup under load")
    _save(fig, path)
    return None


def speedup_by_batch_size_figure(batch: pd.DataFrame):
    """Speedup over target-only greedy at each batch size, one line per method (and variant); None where no variant
    was measured at two or more sizes."""
    drafting = batch[batch["method"] != BASELINE].dropna(subset=["speedup"])
    swept = drafting.groupby("variant")["batch_size"].nunique()
    drafting = drafting[drafting["variant"].isin(swept[swept >= 2].index)]
    if drafting.empty:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    df = drafting.assign(method=drafting["method"].map(method_label))
    order = [method_label(m) for m in method_order(drafting["method"])]
    sns.lineplot(df, x="batch_size", y="speedup", hue="method", hue_order=order,
                 style="variant" if df["variant"].nunique() > 1 else None, markers=True, errorbar=None, ax=ax)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="target-only greedy")
    ax.set_xscale("log", base=2)
    ticks = sorted(df["batch_size"].unique())
    ax.minorticks_off()
    ax.set_xticks(ticks, [str(int(t)) for t in ticks])
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), title=None)
    ax.set(xlabel="batch size (requests in flight; log scale)", ylabel="speedup over target-only greedy",
           title="Throughput under load: where the draft stops paying (below the dashed line)")
    return fig


def training_long(metrics: pd.DataFrame, prefixes: dict[str, str]) -> pd.DataFrame:
    """Long form: one row per (row, TTT step, metric) for the given column prefixes."""
    frames = []
    for prefix, name in prefixes.items():
        for i in ttt_steps(metrics, prefix):
            frames.append(pd.DataFrame({
                "variant": metrics["variant"], "split": metrics["split"], "step": metrics["step"],
                "TTT step": str(i), "metric": name, "value": metrics[f"{prefix}{i}"],
            }))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def plot_training(metrics: pd.DataFrame, prefixes: dict[str, str], ylabel: str, path: Path) -> str | None:
    df = training_long(metrics, prefixes)
    if df.empty:
        return f"metrics.csv has no {'/'.join(prefixes)}* columns"
    variants = variants_in_order(df)
    names = list(dict.fromkeys(df["metric"]))
    fig, axes = plt.subplots(len(names), len(variants), figsize=(4.5 * len(variants), 3.4 * len(names)),
                             squeeze=False, sharey="row", layout="constrained")
    for (i, name), (j, variant) in itertools.product(enumerate(names), enumerate(variants)):
        ax = axes[i][j]
        cell = df[(df["metric"] == name) & (df["variant"] == variant)]
        sns.lineplot(cell, x="step", y="value", hue="TTT step", style="split", style_order=["train", "val"],
                     dashes={"train": "", "val": (4, 2)}, markers={"train": ".", "val": "o"}, estimator=None,
                     errorbar=None, legend=(i, j) == (0, len(variants) - 1), ax=ax)
        ax.set(title=f"{name} | {variant}" if len(names) > 1 else variant,
               xlabel="optimizer step" if i == len(names) - 1 else "", ylabel=ylabel if j == 0 else "")
    legend = axes[0][-1].get_legend()
    if legend is not None:
        sns.move_legend(axes[0][-1], "upper left", bbox_to_anchor=(1.02, 1))
    _save(fig, path)


def plot_acceptance_by_category(by_category: pd.DataFrame, path: Path) -> str | None:
    long = by_category.drop(columns="prompts").melt(id_vars="category", var_name="method", value_name="acceptance")
    if long.dropna().empty:
        return "the benchmark has no drafting method, so no acceptance per category"
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(by_category)), 4.5))
    sns.barplot(long.dropna(), x="category", y="acceptance", hue="method", errorbar=None, ax=ax)
    ax.set(xlabel="", ylabel="tokens per target forward", title="Acceptance length per prompt category")
    ax.tick_params(axis="x", rotation=20)
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), title=None)
    _save(fig, path)


# the learning curve's lines: the report table's column -> the legend's name
CURVES = {"acceptance length": "measured: tokens per target forward",
          "tokens per drafted round": "measured: tokens per drafted round",
          "predicted acceptance length": "predicted by validation (per drafted round)"}


def learning_curve_long(data_size: pd.DataFrame) -> pd.DataFrame:
    """The learning-curve table in long form: one row per (variant, curve) with a value."""
    present = [c for c in CURVES if c in data_size]
    long = data_size.melt(id_vars=["variant", "datasets", "train tokens"], value_vars=present, var_name="curve",
                          value_name="tokens")
    long["tokens"] = pd.to_numeric(long["tokens"], errors="coerce")
    long = long.dropna(subset=["tokens"])
    long["curve"] = long["curve"].map(CURVES)
    return long


def plot_data_size(data_size: pd.DataFrame, path: Path) -> str | None:
    """The learning curve: measured acceptance against the training tokens, with validation's prediction beside it."""
    df = data_size.dropna(subset=["acceptance length"])
    if df["train tokens"].nunique() < 2:
        return ("every benchmarked draft trained on the same amount of data, so there is no curve to draw: add a "
                "variant with another `data_fraction` (e.g. 0.5)")
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    long = learning_curve_long(df)
    # one line per curve and set of datasets: a variant on other datasets is another kind of data, not another amount
    style = "datasets" if long["datasets"].nunique() > 1 else "curve"
    sns.lineplot(long, x="train tokens", y="tokens", hue="curve", hue_order=[c for c in CURVES.values()
                                                                             if c in set(long["curve"])],
                 style=style, markers=True, errorbar=None, ax=ax)
    for r in df.to_dict("records"):
        ax.annotate(f"{r['variant']} ({r['acceptance length']:.2f})", (r["train tokens"], r["acceptance length"]),
                    textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xscale("log")
    ticks = sorted(df["train tokens"].unique())  # the variants' sizes, not log-scale minor ticks over each other
    ax.minorticks_off()
    ax.set_xticks(ticks, [f"{int(t):,}" for t in ticks])
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1), title=None)
    ax.set(xlabel="training tokens (log scale)", ylabel="tokens",
           title="What the amount of training data buys: measured and predicted acceptance")
    _save(fig, path)


def plot_data_stats(stats: pd.DataFrame, path: Path) -> None:
    records = []
    for r in stats.itertuples():
        records.append({"dataset": r.dataset, "records": "kept", "count": r.records_kept})
        for reason, n in sorted(r.skipped_by_reason.items()):
            records.append({"dataset": r.dataset, "records": f"skipped: {reason}", "count": n})
        for reason, n in sorted(r.dropped_by_regenerate_by_reason.items()):
            records.append({"dataset": r.dataset, "records": f"dropped by regenerate: {reason}", "count": n})
    tokens = stats.melt(id_vars="dataset", value_vars=["tokens", "assistant_tokens"], var_name="tokens",
                        value_name="count")
    tokens["tokens"] = tokens["tokens"].map({"tokens": "all", "assistant_tokens": "assistant (trained on)"})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    sns.barplot(pd.DataFrame(records), x="dataset", y="count", hue="records", errorbar=None, ax=left)
    for container in left.containers:
        left.bar_label(container, fontsize=8)
    left.set(title="Records kept and skipped", ylabel="records")
    sns.barplot(tokens, x="dataset", y="count", hue="tokens", errorbar=None, ax=right)
    for container in right.containers:
        right.bar_label(container, fontsize=8)
    right.set(title="Tokens after truncation", ylabel="tokens")
    for ax in (left, right):
        sns.move_legend(ax, "upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, title=None, frameon=False)
    _save(fig, path)


def draw_figures(methods, per_prompt, metrics, stats, by_category, data_size, figures_dir: Path,
                 batch=None) -> dict[str, str]:
    """Every figure with something to show as figures_dir/<name>.png; returns the others' names with why each was
    left out."""
    sns.set_theme(style="whitegrid", context="notebook")
    batch = batch if batch is not None else pd.DataFrame(columns=["variant", "method", "batch_size", "speedup"])
    jobs = {
        "speedup_by_batch_size": lambda p: plot_speedup_by_batch_size(batch, p),
        "acceptance_length": lambda p: plot_acceptance_length(methods, per_prompt, p),
        "per_position_acceptance": lambda p: plot_per_position(methods, p),
        "throughput": lambda p: plot_throughput(methods, p),
        "training_loss": lambda p: plot_training(metrics, {"loss_": "loss"}, "loss (KL to target)", p),
        "training_accuracy": lambda p: plot_training(
            metrics, {"full_acc_": "full accuracy", "cond_acc_": "conditional accuracy"}, "accuracy", p),
        "acceptance_by_category": lambda p: plot_acceptance_by_category(by_category, p),
        "data_size": lambda p: plot_data_size(data_size, p),
        "data_stats": lambda p: plot_data_stats(stats, p),
    }
    left_out = {}
    for name in tqdm(FIGURES, desc="report figures", unit="fig"):
        why = jobs[name](figures_dir / f"{name}.png")
        if why:
            left_out[name] = why
            log.info("figure %s left out: %s", name, why)
        else:
            log.info("figure %s.png written", name)
    return left_out
