"""The final report: seaborn figures, tables and provenance as self-contained HTML and Markdown.

Inputs are the pipeline's own outputs (benchmark summaries and per-prompt tables, training
metrics, draft configs, dataset stats, shard manifests). Every number shown is read from
them; nothing is hard-coded. Figures are PNGs in one directory, which the Snakemake rule
also registers with `report()`, so `snakemake --report` shows them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pandas as pd
import yaml

from draftsmith.artefacts import job_benchmark_files
from draftsmith.io import atomic_dir, write_text
from draftsmith.report.backends import backend_findings, backends_table
from draftsmith.report.figures import FIGURES, draw_figures
from draftsmith.report.load import (
    ReportInputError,
    load_batch_sizes,
    load_drafts,
    load_manifests,
    load_metrics,
    load_per_prompt,
    load_stats,
    load_summaries,
    load_training_data,
)
from draftsmith.report.render import plain_config, render_html, render_markdown
from draftsmith.report.tables import (
    acceptance_by_category,
    checksums,
    findings,
    fmt,
    in_variant_order,
    inputs_table,
    load_table,
    speed_table,
    stats_table,
    summary_table,
    training_table,
    versions_table,
)
from draftsmith.report.learning_curve import learning_curve, report_table, write_csv
from draftsmith.report.stage_times import stage_times, total_line
from draftsmith.report.verdict import cpu_demo_note, predicted_table, verdict_lines

__all__ = ["FIGURES", "ReportInputError", "build_report", "fmt"]

log = logging.getLogger(__name__)


def build_report(summaries, per_prompt, metrics, drafts, training_data, stats, manifests, config, out_html, out_md,
                 figures_dir, reference=(), out_csv=None, benchmarks=None,
                 variant_order=None) -> dict[str, pd.DataFrame]:
    """Build figures, HTML and Markdown from the pipeline's outputs; return the tables (raw values).

    `variant_order`: the variants in the config's order (default: the order of `config["variants"]`), the order of
    every table, figure and verdict; variants not in it follow in the order their summaries are given.
    `reference`: the offline benchmark's summaries beside vllm ones (benchmark.offline_reference), shown side by side.
    `out_csv`: where to write the learning curve (draftsmith.report.learning_curve) as CSV, the table `learning_curve`.
    `benchmarks`: the rules' Snakemake benchmark files (draftsmith.report.stage_times), the table `stages`."""
    out_html, out_md, figures_dir = Path(out_html), Path(out_md), Path(figures_dir)
    summary_by_variant, methods = load_summaries(summaries)
    given = list(variant_order if variant_order is not None else (config.get("variants") or {}))
    order = [v for v in given if v in summary_by_variant] + [v for v in summary_by_variant if v not in given]
    summary_by_variant = {v: summary_by_variant[v] for v in order}
    methods = in_variant_order(methods, order)
    per_prompt_df = in_variant_order(load_per_prompt(per_prompt, set(summary_by_variant)), order)
    metrics_df = in_variant_order(load_metrics(metrics), order)
    stats_df = load_stats(stats)
    shards_df, manifest_list = load_manifests(manifests)
    log.info("report inputs: %d variants, %d datasets, %d shards", len(summary_by_variant), len(stats_df),
             len(shards_df))
    by_category = acceptance_by_category(per_prompt_df)
    batch = load_batch_sizes(summary_by_variant)
    training = training_table(metrics_df)
    curve = learning_curve(load_training_data(training_data), training, methods, summary_by_variant)
    data_size = report_table(curve)
    predicted = predicted_table(training, methods, summary_by_variant)
    inputs = {"benchmark summary": list(summaries), "benchmark per-prompt": list(per_prompt),
              "offline reference summary": list(reference), "training metrics": list(metrics),
              "draft config": list(drafts), "training data": list(training_data), "dataset stats": list(stats),
              "shard manifest": list(manifests)}
    tables = {
        "summary": summary_table(methods),
        "speed": speed_table(methods),
        "load": load_table(batch),
        "predicted": predicted,
        "categories": by_category,
        "data_size": data_size,
        "training": training,
        "drafts": load_drafts(drafts),
        "data": stats_table(stats_df),
        **({"shards": shards_df} if not shards_df.empty else {}),  # none online
        "versions": versions_table(summary_by_variant, manifest_list),
        "inputs": inputs_table({kind: paths for kind, paths in inputs.items() if paths}),
    }
    verdict = verdict_lines(summary_by_variant, methods, predicted, data_size)
    notes = [note for note in [cpu_demo_note(summary_by_variant, config)] if note]
    lines = findings(summary_by_variant, methods, stats_df, metrics_df, by_category, data_size, batch)
    # the jobs of this config only: a variant renamed away left its files behind
    stages = stage_times(benchmarks, job_benchmark_files(config)) if benchmarks is not None else pd.DataFrame()
    if not stages.empty:
        tables["stages"] = stages
        lines.append(total_line(stages))
    if reference:
        backends = in_variant_order(backends_table(summaries, reference), order)
        tables["backends"] = backends.drop(columns="_differ")
        lines += backend_findings(backends)
    config_yaml = yaml.safe_dump(plain_config(config), sort_keys=False)
    title = "draftsmith report: EAGLE-3 draft " + ", ".join(summary_by_variant)
    with atomic_dir(figures_dir) as tmp:
        left_out = draw_figures(methods, per_prompt_df, metrics_df, stats_df, by_category, data_size, tmp, batch)
    sums = checksums(tables["inputs"])
    if out_csv is not None:
        write_csv(curve, out_csv)
    write_text(out_html, render_html(title, verdict, lines, tables, figures_dir, config_yaml, sums, notes, left_out))
    figures_rel = Path(os.path.relpath(figures_dir, out_md.parent)).as_posix()
    write_text(out_md, render_markdown(title, verdict, lines, tables, figures_rel, config_yaml, sums, notes, left_out))
    log.info("report written: %s, %s, %s%s", out_html, out_md, figures_dir, "" if out_csv is None else f", {out_csv}")
    return {**tables, "learning_curve": curve}
