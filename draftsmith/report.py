"""The final report: seaborn figures, tables and provenance as self-contained HTML and Markdown.

Inputs are the pipeline's own outputs (benchmark summaries and per-prompt tables, training
metrics, draft configs, dataset stats, shard manifests). Every number shown is read from
them; nothing is hard-coded. Figures are PNGs in one directory, which the Snakemake rule
also registers with `report()`, so `snakemake --report` shows them.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
import logging
import math
import os
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402

from draftsmith.bench_results import BASELINE  # noqa: E402
from draftsmith.io import atomic_dir, read_json, sha256_file, write_text  # noqa: E402
from draftsmith.shards import package_versions  # noqa: E402

log = logging.getLogger(__name__)

METHOD_ORDER = ["target_greedy", "prompt_lookup", "untrained_draft", "eagle3_draft"]
METHOD_LABELS = {
    "target_greedy": "target-only greedy",
    "prompt_lookup": "prompt lookup",
    "untrained_draft": "untrained draft",
    "eagle3_draft": "trained EAGLE-3 draft",
}
FIGURES = {
    "acceptance_length": "Acceptance length (tokens per target forward) by method",
    "per_position_acceptance": "Acceptance rate by draft position",
    "throughput": "Decoding throughput (tokens/s) and speedup over target-only greedy",
    "training_loss": "Training loss per TTT step",
    "training_accuracy": "Training accuracy per TTT step",
    "data_stats": "Dataset records and tokens",
}
SUMMARY_FIELDS = ["prompts", "acceptance_length", "per_position_acceptance", "tokens_per_s", "speedup"]
PER_PROMPT_COLUMNS = ["variant", "backend", "method", "prompt_id", "acceptance_length", "tokens_per_s", "speedup"]
METRICS_COLUMNS = ["variant", "split", "epoch", "step", "loss"]
STATS_FIELDS = ["records_read", "records_kept", "records_skipped", "skipped_by_reason", "records_truncated",
                "tokens", "assistant_tokens", "seq_length"]
MANIFEST_FIELDS = ["shard", "num_samples", "num_tokens", "device"]


class ReportInputError(ValueError):
    """An input file the report cannot use; the message names the file and the field."""


def _require(record: dict, fields, where: str) -> None:
    missing = [f for f in fields if f not in record]
    if missing:
        raise ReportInputError(f"{where}: missing field(s) {', '.join(missing)}")


def _read_json(path, where_kind: str) -> dict:
    try:
        return read_json(path)
    except (OSError, json.JSONDecodeError) as e:
        raise ReportInputError(f"{path}: cannot read {where_kind}: {e}") from e


def _read_csv(path, columns: list[str]) -> pd.DataFrame:
    try:
        df = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise ReportInputError(f"{path}: cannot read CSV: {e}") from e
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ReportInputError(f"{path}: missing column(s) {', '.join(missing)}")
    return df


def method_label(method: str) -> str:
    return METHOD_LABELS.get(method, method)


def _method_order(methods) -> list[str]:
    present = list(dict.fromkeys(methods))
    return [m for m in METHOD_ORDER if m in present] + [m for m in present if m not in METHOD_ORDER]


# ----------------------------------------------------------------------------- loading


def load_summaries(paths) -> tuple[dict[str, dict], pd.DataFrame]:
    """Summary JSONs by variant, and one row per (variant, method) with per-position rates as a list."""
    by_variant, rows = {}, []
    for path in paths:
        summary = _read_json(path, "benchmark summary")
        _require(summary, ["variant", "backend", "device", "methods"], str(path))
        variant = summary["variant"]
        if variant in by_variant:
            raise ReportInputError(f"{path}: variant {variant!r} appears in more than one summary")
        by_variant[variant] = summary
        for method, m in summary["methods"].items():
            _require(m, SUMMARY_FIELDS, f"{path}: methods.{method}")
            rows.append({
                "variant": variant,
                "backend": summary["backend"],
                "device": summary["device"],
                "method": method,
                "prompts": m["prompts"],
                "acceptance_length": m["acceptance_length"],
                "per_position_acceptance": m["per_position_acceptance"],
                "tokens_per_s": m["tokens_per_s"],
                "speedup": m["speedup"],
                "lossless": m.get("lossless"),
            })
    if not rows:
        raise ReportInputError("no benchmark summaries were given")
    return by_variant, pd.DataFrame(rows)


def load_per_prompt(paths, variants) -> pd.DataFrame:
    frames = []
    for path in paths:
        df = _read_csv(path, PER_PROMPT_COLUMNS)
        unknown = sorted(set(df["variant"]) - set(variants))
        if unknown:
            raise ReportInputError(f"{path}: column variant has {unknown}, which no benchmark summary describes")
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=PER_PROMPT_COLUMNS)


def load_metrics(paths) -> pd.DataFrame:
    frames = []
    for path in paths:
        df = _read_csv(path, METRICS_COLUMNS)
        bad = sorted(set(df["split"]) - {"train", "val"})
        if bad:
            raise ReportInputError(f"{path}: column split has {bad}; expected train or val")
        if not any(re.fullmatch(r"loss_\d+", c) for c in df.columns):
            raise ReportInputError(f"{path}: no per-TTT-step loss columns (loss_0, loss_1, ...)")
        frames.append(df)
    if not frames:
        raise ReportInputError("no training metrics were given")
    return pd.concat(frames, ignore_index=True)


def load_drafts(paths) -> pd.DataFrame:
    """One row per draft checkpoint config (speculators Eagle3 config.json); variant = its directory name."""
    rows = []
    for path in paths:
        cfg = _read_json(path, "draft config")
        _require(cfg, ["draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "transformer_layer_config",
                       "speculators_config"], str(path))
        layer = cfg["transformer_layer_config"]
        spec = cfg["speculators_config"]
        proposals = spec.get("proposal_methods") or [{}]
        rows.append({
            "variant": Path(path).parent.name,
            "draft layers": layer.get("num_hidden_layers"),
            "hidden size": layer.get("hidden_size"),
            "draft vocab": cfg["draft_vocab_size"],
            "target vocab": layer.get("vocab_size"),
            "aux layer ids": ", ".join(map(str, cfg["eagle_aux_hidden_state_layer_ids"])),
            "speculative tokens": proposals[0].get("speculative_tokens"),
            "verifier": spec.get("verifier", {}).get("name_or_path"),
            "speculators": cfg.get("speculators_version"),
            "config sha256": sha256_file(path),
        })
    return pd.DataFrame(rows)


def load_stats(paths) -> pd.DataFrame:
    rows = []
    for path in paths:
        stats = _read_json(path, "dataset stats")
        _require(stats, STATS_FIELDS, str(path))
        rows.append({"dataset": stats.get("dataset") or Path(path).parent.name,
                     **{k: stats[k] for k in STATS_FIELDS}})
    return pd.DataFrame(rows)


def load_manifests(paths) -> tuple[pd.DataFrame, list[dict]]:
    """Shard provenance rows (dataset from `.../shards/{dataset}/shard_{k}/manifest.json`) and the raw manifests."""
    rows, manifests = [], []
    for path in paths:
        manifest = _read_json(path, "shard manifest")
        _require(manifest, MANIFEST_FIELDS, str(path))
        manifests.append(manifest)
        rows.append({
            "dataset": Path(path).parent.parent.name,
            "shard": manifest["shard"],
            "backend": manifest.get("backend"),
            "samples": manifest["num_samples"],
            "tokens": manifest["num_tokens"],
            "tokens/s": manifest.get("tokens_per_second"),
            "device": manifest["device"],
            "dtype": manifest.get("dtype"),
            "layer ids": ", ".join(map(str, manifest.get("layer_ids", []))),
            "manifest sha256": sha256_file(path),
        })
    return pd.DataFrame(rows), manifests


# ----------------------------------------------------------------------------- tables


def summary_table(methods: pd.DataFrame) -> pd.DataFrame:
    order = {m: i for i, m in enumerate(_method_order(methods["method"]))}
    df = methods.assign(_o=methods["method"].map(order)).sort_values(["variant", "_o"]).drop(columns="_o")
    return pd.DataFrame({
        "variant": df["variant"],
        "backend": df["backend"],
        "method": df["method"],
        "prompts": df["prompts"],
        "acceptance length": df["acceptance_length"],
        "per-position acceptance": df["per_position_acceptance"],
        "tokens/s": df["tokens_per_s"],
        "speedup": df["speedup"],
        "lossless": df["lossless"],
    }).reset_index(drop=True)


def ttt_steps(metrics: pd.DataFrame, prefix: str) -> list[int]:
    return sorted(int(c[len(prefix):]) for c in metrics.columns if re.fullmatch(re.escape(prefix) + r"\d+", c))


def training_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """Final values per variant: last train row, last validation row (when there is one)."""
    rows = []
    acc_steps = ttt_steps(metrics, "full_acc_")
    for variant, g in metrics.groupby("variant", sort=True):
        train, val = g[g["split"] == "train"], g[g["split"] == "val"]
        last_train = train.sort_values("step").iloc[-1] if len(train) else None
        last_val = val.sort_values("step").iloc[-1] if len(val) else None
        row = {
            "variant": variant,
            "epochs": int(g["epoch"].max()) + 1,
            "steps": len(train),
            "final train loss": last_train["loss"] if last_train is not None else None,
            "final val loss": last_val["loss"] if last_val is not None else None,
        }
        for i in acc_steps:
            row[f"val full acc {i}"] = last_val[f"full_acc_{i}"] if last_val is not None else None
        rows.append(row)
    return pd.DataFrame(rows)


def stats_table(stats: pd.DataFrame) -> pd.DataFrame:
    df = stats.copy()
    df["skipped_by_reason"] = df["skipped_by_reason"].map(
        lambda d: ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "none")
    return df.rename(columns=lambda c: c.replace("_", " "))


def versions_table(summaries: dict[str, dict], manifests: list[dict]) -> pd.DataFrame:
    """Package versions and device per stage: extraction (one column per device), benchmark per variant, this report."""
    columns: dict[str, dict] = {}
    for m in manifests:
        key = f"extraction ({m['device']})"
        columns.setdefault(key, {**m.get("versions", {}), "device": m["device"]})
    for variant, s in summaries.items():
        columns[f"benchmark {variant}"] = {**s.get("versions", {}), "device": s["device"]}
    columns["report"] = package_versions(("pandas", "seaborn", "matplotlib", "snakemake", "draftsmith"))
    df = pd.DataFrame(columns)
    rows = ["device"] + sorted(i for i in df.index if i != "device")
    return df.reindex(rows).fillna("").rename_axis("package").reset_index()


def inputs_table(groups: dict[str, list]) -> pd.DataFrame:
    rows = [{"input": kind, "file": str(p), "sha256": sha256_file(p)} for kind, paths in groups.items() for p in paths]
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------- figures


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def plot_acceptance_length(methods: pd.DataFrame, per_prompt: pd.DataFrame, path: Path) -> None:
    order = _method_order(methods["method"])
    variants = sorted(methods["variant"].unique())
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


def plot_per_position(methods: pd.DataFrame, path: Path) -> None:
    df = per_position_frame(methods)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if len(df):
        sns.lineplot(df, x="position", y="rate", hue="method", style="variant", markers=True, errorbar=None, ax=ax)
        ax.set_xticks(sorted(df["position"].unique()))
        sns.move_legend(ax, "upper left", bbox_to_anchor=(1.02, 1))
    else:
        ax.text(0.5, 0.5, "no drafting method in the benchmark", ha="center", transform=ax.transAxes)
    ax.set(ylim=(0, 1.02), xlabel="draft position", ylabel="fraction of drafts accepted up to here",
           title="Per-position acceptance")
    _save(fig, path)


def plot_throughput(methods: pd.DataFrame, path: Path) -> None:
    order = _method_order(methods["method"])
    variants = sorted(methods["variant"].unique())
    fig, ax = plt.subplots(figsize=(8, 4.5))
    sns.barplot(methods, x="method", y="tokens_per_s", hue="variant", order=order, hue_order=variants,
                errorbar=None, ax=ax)
    speedup = methods.set_index(["variant", "method"])["speedup"]
    for variant, container in zip(variants, ax.containers):  # one container per variant, in hue order
        labels = []
        for bar in container:
            method = order[round(bar.get_x() + bar.get_width() / 2)]
            value = speedup.get((variant, method))
            labels.append(f"{value:.2f}×" if value is not None and pd.notna(value) else "")
        ax.bar_label(container, labels=labels, fontsize=8, padding=2)
    ax.set_xticks(range(len(order)), [method_label(m) for m in order])
    ax.set(xlabel="", ylabel="generated tokens/s", title="Throughput (labels: speedup over target-only greedy)")
    ax.margins(y=0.12)
    _save(fig, path)


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


def plot_training(metrics: pd.DataFrame, prefixes: dict[str, str], ylabel: str, path: Path) -> None:
    df = training_long(metrics, prefixes)
    if df.empty:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, f"no {'/'.join(prefixes)}* columns in metrics.csv", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        _save(fig, path)
        return
    variants = sorted(df["variant"].unique())
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


def plot_data_stats(stats: pd.DataFrame, path: Path) -> None:
    records = []
    for r in stats.itertuples():
        records.append({"dataset": r.dataset, "records": "kept", "count": r.records_kept})
        for reason, n in sorted(r.skipped_by_reason.items()):
            records.append({"dataset": r.dataset, "records": f"skipped: {reason}", "count": n})
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


def draw_figures(methods, per_prompt, metrics, stats, figures_dir: Path) -> None:
    sns.set_theme(style="whitegrid", context="notebook")
    jobs = {
        "acceptance_length": lambda p: plot_acceptance_length(methods, per_prompt, p),
        "per_position_acceptance": lambda p: plot_per_position(methods, p),
        "throughput": lambda p: plot_throughput(methods, p),
        "training_loss": lambda p: plot_training(metrics, {"loss_": "loss"}, "loss (KL to target)", p),
        "training_accuracy": lambda p: plot_training(
            metrics, {"full_acc_": "full accuracy", "cond_acc_": "conditional accuracy"}, "accuracy", p),
        "data_stats": lambda p: plot_data_stats(stats, p),
    }
    for name in tqdm(FIGURES, desc="report figures", unit="fig"):
        jobs[name](figures_dir / f"{name}.png")
        log.info("figure %s.png written", name)


# ----------------------------------------------------------------------------- text


def fmt(value, digits: int = 3) -> str:
    """One formatting for every number in the report (tables and text alike)."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return " / ".join(fmt(v, digits) for v in value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


# digits per table column; other float columns get 3
DIGITS = {"tokens/s": 1, "speedup": 2, "final train loss": 4, "final val loss": 4}


def display(df: pd.DataFrame) -> pd.DataFrame:
    """Strings for every cell, numbers formatted by `fmt` with the column's digits."""
    return pd.DataFrame({col: [fmt(v, DIGITS.get(col, 3)) for v in df[col]] for col in df.columns}, index=df.index)


def _method_values(methods: pd.DataFrame, variant: str) -> dict[str, dict]:
    return {r["method"]: r for r in methods[methods["variant"] == variant].to_dict("records")}


def findings(summaries: dict, methods: pd.DataFrame, stats: pd.DataFrame, metrics: pd.DataFrame) -> list[str]:
    """Plain-language statements computed from the inputs."""
    lines = []
    for variant in sorted(summaries):
        s = summaries[variant]
        m = _method_values(methods, variant)
        where = f"`{variant}` ({s['backend']} backend)"
        draft = m.get("eagle3_draft")
        if draft is None:
            lines.append(f"{where}: the benchmark has no trained-draft (eagle3_draft) results.")
            continue
        baselines = [f"{fmt(m[b]['acceptance_length'], 2)} with {phrase}"
                     for b, phrase in (("prompt_lookup", "prompt lookup"), ("untrained_draft", "the untrained draft"))
                     if b in m]
        text = (f"{where}: the trained draft accepts {fmt(draft['acceptance_length'], 2)} tokens per target forward"
                + (f" vs {' and '.join(baselines)}" if baselines else ""))
        speedup = draft["speedup"]
        if speedup is not None and pd.notna(speedup) and BASELINE in m:
            slower = ", i.e. slower" if speedup < 1 else ""
            text += (f"; speculative decoding ran at {fmt(speedup, 2)}× the speed of target-only greedy decoding"
                     f"{slower} ({fmt(draft['tokens_per_s'], 1)} vs {fmt(m[BASELINE]['tokens_per_s'], 1)} tokens/s"
                     f" on {s['device']})")
        if draft.get("lossless") is False:
            text += "; **its output differed from target-only greedy on some prompts**"
        elif draft.get("lossless") is True:
            text += "; its output matched target-only greedy on every prompt"
        lines.append(text + ".")
    if len(summaries) > 1:
        drafts = methods[methods["method"] == "eagle3_draft"].sort_values("acceptance_length", ascending=False)
        if len(drafts):
            best = drafts.iloc[0]
            lines.append(f"Best variant by acceptance length: `{best['variant']}` "
                         f"({fmt(best['acceptance_length'], 2)}).")
    if len(stats):
        skipped = int(stats["records_skipped"].sum())
        lines.append(
            f"Training data: {fmt(int(stats['records_kept'].sum()))} conversations kept of "
            f"{fmt(int(stats['records_read'].sum()))} read ({fmt(skipped)} skipped) from "
            f"{', '.join(f'`{d}`' for d in stats['dataset'])}: {fmt(int(stats['tokens'].sum()))} tokens, "
            f"{fmt(int(stats['assistant_tokens'].sum()))} of them assistant tokens the draft learns from.")
    for r in training_table(metrics).to_dict("records"):
        if r["final val loss"] is not None and pd.notna(r["final val loss"]):
            accs = [r[k] for k in r if k.startswith("val full acc ")]
            lines.append(f"Training `{r['variant']}`: validation loss {fmt(r['final val loss'], 4)} after "
                         f"{fmt(r['steps'])} steps; validation full accuracy per TTT step {fmt(accs, 3)}.")
    return lines


# ----------------------------------------------------------------------------- rendering

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}
h1{border-bottom:2px solid #444}h2{margin-top:2em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.3em .6em;text-align:right;vertical-align:top}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
.findings{background:#f6f8fa;border-left:4px solid #4c72b0;padding:.5em 1em}
figure{margin:1em 0}figure img{max-width:100%;border:1px solid #ddd}
figcaption{font-size:.9em;color:#555}
pre{background:#f6f8fa;padding:1em;overflow-x:auto;font-size:.85em}
code{font-size:.9em}
"""

SECTIONS = [
    ("summary", "Benchmark summary",
     "Acceptance length = generated tokens per target forward (the bonus token included). Per-position "
     "acceptance = fraction of drafts whose first i tokens were all accepted. Speedup = tokens/s over "
     "target-only greedy decoding on the same prompts."),
    ("training", "Training (final values)", "Validation rows are per-epoch averages."),
    ("drafts", "Draft checkpoints", "From each draft's speculators config.json."),
    ("data", "Data", "Records read, kept and skipped per dataset, and tokens after truncation."),
    ("shards", "Hidden-state shards",
     "One row per shard; the manifest checksum covers the sha256 of every sample file it lists."),
    ("versions", "Package versions and devices", ""),
    ("inputs", "Input files", "Every file this report was built from, with its sha256."),
]
FIGURE_SECTIONS = {
    "summary": ["acceptance_length", "per_position_acceptance", "throughput"],
    "training": ["training_loss", "training_accuracy"],
    "data": ["data_stats"],
}


def _md_inline(text: str) -> str:
    """Markdown to HTML for the few inline marks the findings use (`code`, **bold**)."""
    text = html.escape(text)
    text = re.sub(r"`([^`]+)`", r"<code>\1</code>", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", text)


def render_html(title: str, lines: list[str], tables: dict[str, pd.DataFrame], figures_dir: Path,
                config_yaml: str) -> str:
    parts = [f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
             f"<style>{CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>",
             "<h2 id='what-this-means'>What this means</h2><div class='findings'><ul>"]
    parts += [f"<li>{_md_inline(line)}</li>" for line in lines]
    parts.append("</ul></div>")
    for key, heading, note in SECTIONS:
        parts.append(f"<h2 id='{key}'>{html.escape(heading)}</h2>")
        if note:
            parts.append(f"<p>{html.escape(note)}</p>")
        parts.append(display(tables[key]).to_html(index=False, table_id=f"table-{key}", border=0, na_rep="—"))
        for name in FIGURE_SECTIONS.get(key, []):
            data = base64.b64encode((figures_dir / f"{name}.png").read_bytes()).decode("ascii")
            parts.append(f"<figure id='figure-{name}'><img alt='{html.escape(FIGURES[name])}' "
                         f"src='data:image/png;base64,{data}'><figcaption>{html.escape(FIGURES[name])}"
                         f"</figcaption></figure>")
    parts.append(f"<h2 id='config'>Workflow configuration</h2><pre>{html.escape(config_yaml)}</pre>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(title: str, lines: list[str], tables: dict[str, pd.DataFrame], figures_rel: str,
                    config_yaml: str) -> str:
    parts = [f"# {title}", "", "## What this means", ""] + [f"- {line}" for line in lines]
    for key, heading, note in SECTIONS:
        parts += ["", f"## {heading}", ""]
        if note:
            parts += [note, ""]
        parts.append(display(tables[key]).map(_md_cell).to_markdown(index=False, disable_numparse=True))
        for name in FIGURE_SECTIONS.get(key, []):
            parts += ["", f"![{FIGURES[name]}]({figures_rel}/{name}.png)"]
    parts += ["", "## Workflow configuration", "", "```yaml", config_yaml.rstrip(), "```", ""]
    return "\n".join(parts)


def plain_config(config) -> dict:
    """The config as plain YAML-safe data (Snakemake hands in its own dict subclass)."""
    return json.loads(json.dumps(config, default=str))


# ----------------------------------------------------------------------------- entry point


def build_report(summaries, per_prompt, metrics, drafts, stats, manifests, config, out_html, out_md,
                 figures_dir) -> dict[str, pd.DataFrame]:
    """Build figures, HTML and Markdown from the pipeline's outputs; return the tables (raw values)."""
    out_html, out_md, figures_dir = Path(out_html), Path(out_md), Path(figures_dir)
    summary_by_variant, methods = load_summaries(summaries)
    per_prompt_df = load_per_prompt(per_prompt, set(summary_by_variant))
    metrics_df = load_metrics(metrics)
    stats_df = load_stats(stats)
    shards_df, manifest_list = load_manifests(manifests)
    log.info("report inputs: %d variants, %d datasets, %d shards", len(summary_by_variant), len(stats_df),
             len(shards_df))
    tables = {
        "summary": summary_table(methods),
        "training": training_table(metrics_df),
        "drafts": load_drafts(drafts),
        "data": stats_table(stats_df),
        "shards": shards_df,
        "versions": versions_table(summary_by_variant, manifest_list),
        "inputs": inputs_table({"benchmark summary": list(summaries), "benchmark per-prompt": list(per_prompt),
                                "training metrics": list(metrics), "draft config": list(drafts),
                                "dataset stats": list(stats)}),
    }
    lines = findings(summary_by_variant, methods, stats_df, metrics_df)
    config_yaml = yaml.safe_dump(plain_config(config), sort_keys=False)
    title = "draftsmith report: EAGLE-3 draft " + ", ".join(sorted(summary_by_variant))
    with atomic_dir(figures_dir) as tmp:
        draw_figures(methods, per_prompt_df, metrics_df, stats_df, tmp)
    write_text(out_html, render_html(title, lines, tables, figures_dir, config_yaml))
    figures_rel = Path(os.path.relpath(figures_dir, out_md.parent)).as_posix()
    write_text(out_md, render_markdown(title, lines, tables, figures_rel, config_yaml))
    log.info("report written: %s, %s, %s", out_html, out_md, figures_dir)
    return tables
