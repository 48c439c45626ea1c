"""The report's tables and findings, computed from the loaded inputs."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from draftsmith.benchmark.results import BASELINE
from draftsmith.io import sha256_file
from draftsmith.provenance import package_versions
from draftsmith.report.methods import TRAINED_DRAFT, method_label, method_order, other_drafting

# a category with fewer prompts is marked in the categories table and left out when categories are compared
MIN_CATEGORY_PROMPTS = 3
FEW_MARK = "†"


def variants_in_order(df: pd.DataFrame) -> list[str]:
    """The variants in the order they first appear: build_report puts every frame's rows in the config's order."""
    return list(dict.fromkeys(df["variant"]))


def in_variant_order(df: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    """df's rows with the variants in `order` (any other variant after them), each variant's rows as they were."""
    rank = {v: i for i, v in enumerate(order)}
    ranks = df["variant"].map(lambda v: rank.get(v, len(rank))).to_numpy()
    return df.iloc[np.argsort(ranks, kind="stable")].reset_index(drop=True)


def by_variant_and_method(df: pd.DataFrame, *more: str) -> pd.DataFrame:
    """Rows in variant order, then method in the report's order, then the columns `more`."""
    variant = {v: i for i, v in enumerate(variants_in_order(df))}
    method = {m: i for i, m in enumerate(method_order(df["method"]))}
    ranked = df.assign(_v=df["variant"].map(variant), _o=df["method"].map(method))
    return ranked.sort_values(["_v", "_o", *more], kind="stable").drop(columns=["_v", "_o"])


def _columns(df: pd.DataFrame, columns: dict[str, str]) -> pd.DataFrame:
    """A table of df's columns (values) under the report's names (keys)."""
    return pd.DataFrame({name: df[column] for name, column in columns.items()}).reset_index(drop=True)


SUMMARY_COLUMNS = {
    "variant": "variant", "backend": "backend", "method": "method", "prompts": "prompts",
    "acceptance length": "acceptance_length", "per-position acceptance": "per_position_acceptance",
    "tokens per drafted round": "tokens_per_drafted_round", "tokens/s": "tokens_per_s", "speedup": "speedup",
    "lossless": "lossless",
}
SPEED_COLUMNS = {
    "variant": "variant", "method": "method", "timed runs per prompt": "repeats", "speedup": "speedup",
    "speedup range over the runs": "speedup_range", "timing spread (median)": "time_spread",
    "speedup after the first token": "decode_speedup", "c = draft step / target step": "cost_ratio",
    "ideal speedup τ/(1+k·c)": "ideal_speedup", "v = verification / target step": "verify_ratio",
    "round model τ/(v+k·c)": "round_model_speedup",
}
LOAD_COLUMNS = {
    "variant": "variant", "backend": "backend", "method": "method", "concurrency": "batch_size",
    "tokens/s": "tokens_per_s", "speedup": "speedup", "acceptance length": "acceptance_length",
    "time to first token p50 (ms)": "ttft_p50_ms", "time per output token p50 (ms)": "tpot_p50_ms",
    "p90 (ms)": "tpot_p90_ms", "time in refills": "refill_share", "v = verification / target step": "verify_ratio",
    "c = draft step / target step": "cost_ratio",
}


def summary_table(methods: pd.DataFrame) -> pd.DataFrame:
    return _columns(by_variant_and_method(methods), SUMMARY_COLUMNS)


def speed_table(methods: pd.DataFrame) -> pd.DataFrame:
    """Per (variant, method): how the speed was measured and how much to trust it (runs per prompt, the speedup's
    range over the runs, the spread of a prompt's run times), with the first-token-free speedup and the cost model."""
    df = by_variant_and_method(methods)
    ranges = [None if pd.isna(lo) or pd.isna(hi) else (lo, hi) for lo, hi in zip(df["speedup_low"], df["speedup_high"])]
    return _columns(df.assign(speedup_range=ranges), SPEED_COLUMNS)


def load_table(batch: pd.DataFrame) -> pd.DataFrame:
    """Per (variant, method, concurrency): total tokens/s, the speedup over target-only greedy at the same concurrency,
    acceptance length, the requests' latency (time to first token, time per output token after it), the share of the
    run's time in refills and, for a draft, its step costs at that concurrency over a target step's
    (draftsmith.report.load.load_batch_sizes)."""
    df = by_variant_and_method(batch, "batch_size")
    return _columns(df.assign(batch_size=df["batch_size"].astype(int)), LOAD_COLUMNS)


def load_findings(batch: pd.DataFrame) -> list[str]:
    """Per variant measured at two or more batch sizes, one sentence on where the trained draft stops paying: the largest
    size up to which it beats target-only greedy (pays_up_to), and its speedup at the next size."""
    lines = []
    draft = batch[batch["method"] == TRAINED_DRAFT]
    for variant, g in draft.groupby("variant", sort=False):
        g = g.sort_values("batch_size")
        if len(g) < 2:
            continue
        sizes, speedups = [int(s) for s in g["batch_size"]], list(g["speedup"])
        at = {s: x for s, x in zip(sizes, speedups)}
        pays = g["pays_up_to"].iloc[0]
        pays = None if pays is None or pd.isna(pays) else int(pays)
        where = f"`{variant}` ({g['backend'].iloc[0]} backend) under load: the trained draft"
        if pays is None:
            text = (f"{where} does not beat target-only greedy even at concurrency {sizes[0]} "
                    f"({fmt(speedups[0], 2)}×); "
                    + ", ".join(f"at {s} it is {fmt(x, 2)}×" for s, x in zip(sizes[1:], speedups[1:])))
        elif pays == sizes[-1]:
            text = (f"{where} beats target-only greedy at every measured concurrency, up to {pays} "
                    f"({fmt(at[sizes[0]], 2)}× at {sizes[0]}, {fmt(at[pays], 2)}× at {pays})")
        else:
            after = sizes[sizes.index(pays) + 1]
            text = (f"{where} beats target-only greedy up to concurrency {pays} ({fmt(at[sizes[0]], 2)}× at {sizes[0]}"
                    + (f", {fmt(at[pays], 2)}× at {pays}" if pays != sizes[0] else "")
                    + f"); at {after} it is {fmt(at[after], 2)}×")
            later = [s for s in sizes if s > after and pd.notna(at[s]) and at[s] > 1]
            if later:
                text += f", though above 1 again at {', '.join(map(str, later))}"
        lines.append(text + ".")
    return lines


def acceptance_by_category(per_prompt: pd.DataFrame) -> pd.DataFrame:
    """Acceptance length (new tokens / target forwards over the category's prompts) per category, one
    column per (variant, method) that drafts: the shape of the EAGLE-3 paper's MT-Bench tables."""
    drafting = per_prompt[per_prompt["method"] != BASELINE]
    columns = {}
    for method in method_order(drafting["method"]):
        for variant in variants_in_order(drafting):
            g = drafting[(drafting["method"] == method) & (drafting["variant"] == variant)]
            if len(g):
                sums = g.groupby("category")[["new_tokens", "target_forwards"]].sum()
                columns[f"{method_label(method)} ({variant})"] = sums["new_tokens"] / sums["target_forwards"]
    table = pd.DataFrame(columns)
    table.insert(0, "prompts", per_prompt[per_prompt["method"] == BASELINE].groupby("category")["prompt_id"].nunique())
    table = table.rename_axis("category").reset_index()
    few = table["prompts"] < MIN_CATEGORY_PROMPTS
    table["category"] = [f"{c} {FEW_MARK}" if f else c for c, f in zip(table["category"], few)]
    return table


def category_name(label: str) -> str:
    """A category label of the categories table without its few-prompts mark."""
    return label.removesuffix(f" {FEW_MARK}")


def ttt_steps(metrics: pd.DataFrame, prefix: str) -> list[int]:
    return sorted(int(c[len(prefix):]) for c in metrics.columns if re.fullmatch(re.escape(prefix) + r"\d+", c))


def training_table(metrics: pd.DataFrame) -> pd.DataFrame:
    """Final values per variant: last train row, last validation row (when there is one)."""
    rows = []
    acc_steps = ttt_steps(metrics, "full_acc_")
    for variant, g in metrics.groupby("variant", sort=False):
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
    """Per dataset: records read (from the raw data, for a regenerated dataset too), dropped by regenerate and
    skipped by prepare (each by reason), kept, and tokens; for a regenerated dataset, the share of the target's
    answers cut at max_new_tokens and the share stuck in a loop (draftsmith.data.answer_checks)."""
    df = stats.copy()
    for column in ("dropped_by_regenerate_by_reason", "skipped_by_reason"):
        df[column] = df[column].map(lambda d: ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "none")

    def share(part, whole):
        if part is None or whole is None or pd.isna(part) or pd.isna(whole) or not whole:
            return None
        return f"{100 * part / whole:.1f}% ({int(part)} of {int(whole)})"

    answers = df.pop("num_answers") if "num_answers" in df else pd.Series([None] * len(df), index=df.index)
    checks = {"cut at the token limit": df.pop("cut_at_max_new_tokens") if "cut_at_max_new_tokens" in df else None,
              "loops": df.pop("repetitive_answers") if "repetitive_answers" in df else None}
    df = df.rename(columns=lambda c: c.replace("_", " "))
    for name, counts in checks.items():
        df[name] = [share(c, n) for c, n in zip(counts if counts is not None else [None] * len(df), answers)]
    return df


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


def checksums(inputs: pd.DataFrame) -> str:
    """The inputs' full sha256 in `sha256sum` format (`sha256sum -c` checks them); tables show a prefix only."""
    return "".join(f"{r['sha256']}  {r['file']}\n" for r in inputs.to_dict("records"))


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
DIGITS = {"tokens/s": 1, "speedup": 2, "speedup after the first token": 2, "ideal speedup τ/(1+k·c)": 2,
          "final train loss": 4, "final val loss": 4, "speedup range over the runs": 2,
          "predicted tokens per drafted round": 2, "tokens per drafted round (benchmark)": 2}
PERCENT = {"timing spread (median)"}  # fractions shown as percentages
RANGES = {"speedup range over the runs"}  # (low, high) pairs shown as "low–high"
SHORT_SHA = 12  # hex digits of a sha256 shown in tables (the full ones: `checksums`)


def _cell(col: str, value) -> str:
    digits = DIGITS.get(col, 3)
    if col in RANGES and isinstance(value, (list, tuple)):
        return f"{fmt(value[0], digits)}–{fmt(value[1], digits)}"
    if col in PERCENT and isinstance(value, (int, float, np.generic)) and not pd.isna(value):
        return f"{fmt(100 * float(value), 0)}%"
    if col.endswith("sha256") and isinstance(value, str) and len(value) == 64:
        return value[:SHORT_SHA] + "…"
    return fmt(value, digits)


def display(df: pd.DataFrame) -> pd.DataFrame:
    """Strings for every cell, numbers formatted by `fmt` with the column's digits (ranges as low–high, spreads as
    percentages, sha256 values shortened to a prefix)."""
    return pd.DataFrame({col: [_cell(col, v) for v in df[col]] for col in df.columns}, index=df.index)


def _method_values(methods: pd.DataFrame, variant: str) -> dict[str, dict]:
    return {r["method"]: r for r in methods[methods["variant"] == variant].to_dict("records")}


def category_findings(by_category: pd.DataFrame) -> list[str]:
    """The categories where the trained draft accepts most and least, among those with enough prompts."""
    lines = []
    if by_category.empty or "prompts" not in by_category:
        return lines
    enough = by_category[by_category["prompts"] >= MIN_CATEGORY_PROMPTS]
    few = len(by_category) - len(enough)
    for col in (c for c in by_category.columns if c.startswith(method_label(TRAINED_DRAFT))):
        if enough["category"].nunique() > 1 and enough[col].notna().any():
            best, worst = enough.loc[enough[col].idxmax()], enough.loc[enough[col].idxmin()]
            lines.append(f"By prompt category, the {col} accepts most on `{best['category']}` "
                         f"({fmt(best[col], 2)}) and least on `{worst['category']}` ({fmt(worst[col], 2)})"
                         + (f", among the categories with {MIN_CATEGORY_PROMPTS} or more prompts" if few else "") + ".")
    if few and by_category["category"].nunique() > 1:
        lines.append(f"{fmt(few)} of {fmt(len(by_category))} prompt categories have fewer than {MIN_CATEGORY_PROMPTS} "
                     f"prompts (marked {FEW_MARK}): their per-category figures rest on too few prompts to compare "
                     f"categories" + ("." if len(enough) > 1 else ", so no category is ranked."))
    return lines


def data_size_findings(data_size: pd.DataFrame) -> list[str]:
    df = data_size.dropna(subset=["acceptance length"])
    if df["train tokens"].nunique() < 2:
        return []
    def point(r):
        on = "" if df["datasets"].nunique() < 2 else f" of {r['datasets']}"
        return f"{fmt(r['acceptance length'], 2)} from {fmt(int(r['train tokens']))} tokens{on} (`{r['variant']}`)"

    return [f"What the amount of training data buys: trained-draft acceptance length "
            f"{', '.join(point(r) for r in df.to_dict('records'))}."]


def findings(summaries: dict, methods: pd.DataFrame, stats: pd.DataFrame, metrics: pd.DataFrame,
             by_category: pd.DataFrame, data_size: pd.DataFrame, batch: pd.DataFrame | None = None) -> list[str]:
    """Plain-language statements computed from the inputs; `batch`: every method at every batch size
    (draftsmith.report.load.load_batch_sizes), for where the draft stops paying under load."""
    lines = []
    for variant in summaries:
        s = summaries[variant]
        m = _method_values(methods, variant)
        where = f"`{variant}` ({s['backend']} backend)"
        draft = m.get(TRAINED_DRAFT)
        if draft is None:
            lines.append(f"{where}: the benchmark has no trained-draft ({TRAINED_DRAFT}) results.")
            continue
        baselines = [f"{fmt(m[b]['acceptance_length'], 2)} with {method_label(b)}" for b in other_drafting(m)]
        text = (f"{where}: the trained draft accepts {fmt(draft['acceptance_length'], 2)} tokens per target forward"
                + (f" vs {', '.join(baselines)}" if baselines else ""))
        speedup = draft["speedup"]
        if speedup is not None and pd.notna(speedup) and BASELINE in m:
            slower = ", i.e. slower" if speedup < 1 else ""
            low, high = draft.get("speedup_low"), draft.get("speedup_high")
            runs = (f", {fmt(low, 2)}–{fmt(high, 2)}× over {int(draft['repeats'])} timed runs"
                    if low is not None and pd.notna(low) and pd.notna(high) else "")
            text += (f"; speculative decoding ran at {fmt(speedup, 2)}× the speed of target-only greedy decoding"
                     f"{slower} ({fmt(draft['tokens_per_s'], 1)} vs {fmt(m[BASELINE]['tokens_per_s'], 1)} tokens/s"
                     f" on {s['device']}{runs})")
        ideal = draft.get("ideal_speedup")
        if ideal is not None and pd.notna(ideal):
            text += (f"; a draft step costs c = {fmt(draft['cost_ratio'], 3)} target steps, and with k = "
                     f"{s.get('num_speculative_tokens')} draft steps per round the cost model τ/(1+k·c) (a round "
                     f"costing only its draft steps and one target step) gives {fmt(ideal, 2)}×")
            modelled, v = draft.get("round_model_speedup"), draft.get("verify_ratio")
            if modelled is not None and pd.notna(modelled) and v is not None and pd.notna(v):
                text += (f"; its verification over k + 1 tokens costs v = {fmt(v, 2)} one-token steps, and with that "
                         f"the round's model τ/(v+k·c) gives {fmt(modelled, 2)}×")
        if draft.get("lossless") is False:
            text += (f"; **its output differed from target-only greedy on {draft['mismatched_count']} of "
                     f"{draft['prompts']} prompts**")
            gap = draft.get("max_divergence_gap")
            if gap is not None and pd.notna(gap):
                text += (f" (where each first differed, the target's logit for its own token exceeded the emitted "
                         f"token's by at most {fmt(gap, 3)}; 0 is an exact tie)")
        elif draft.get("lossless") is True:
            text += "; its output matched target-only greedy on every prompt"
        unrepeatable = [f"{method_label(r['method'])} on {fmt(int(r['unrepeatable_count']))}"
                        for r in m.values() if r.get("unrepeatable_count")]
        if unrepeatable:
            text += (f"; **a later timed run decoded other tokens than the first ({', '.join(unrepeatable)} prompts): "
                     f"greedy decoding should repeat exactly**")
        lines.append(text + ".")
    if len(summaries) > 1:
        drafts = methods[methods["method"] == TRAINED_DRAFT].sort_values("acceptance_length", ascending=False)
        if len(drafts):
            best = drafts.iloc[0]
            lines.append(f"Best variant by acceptance length: `{best['variant']}` "
                         f"({fmt(best['acceptance_length'], 2)}).")
    if batch is not None:
        lines += load_findings(batch)
    lines += category_findings(by_category) + data_size_findings(data_size)
    if len(stats):
        skipped = int(stats["records_skipped"].sum())
        dropped = int(stats["dropped_by_regenerate"].sum())
        before = f"{fmt(dropped)} prompts dropped before the target answered, " if dropped else ""
        kept, read = int(stats["records_kept"].sum()), int(stats["records_read"].sum())
        # regenerate.samples_per_prompt > 1: each prompt read gives several answers, so more are kept than read
        several = "; a prompt answered n times counts once read and n times kept" if kept > read else ""
        lines.append(
            f"Training data: {fmt(kept)} conversations kept of "
            f"{fmt(read)} read ({before}{fmt(skipped)} skipped{several}) from "
            f"{', '.join(f'`{d}`' for d in stats['dataset'])}: {fmt(int(stats['tokens'].sum()))} tokens, "
            f"{fmt(int(stats['assistant_tokens'].sum()))} of them assistant tokens the draft learns from.")
    for r in training_table(metrics).to_dict("records"):
        if r["final val loss"] is not None and pd.notna(r["final val loss"]):
            accs = [r[k] for k in r if k.startswith("val full acc ")]
            lines.append(f"Training `{r['variant']}`: validation loss {fmt(r['final val loss'], 4)} after "
                         f"{fmt(r['steps'])} steps; validation full accuracy per TTT step {fmt(accs, 3)}.")
    return lines
