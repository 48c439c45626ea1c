"""Reading the report's inputs (the pipeline's own outputs), each checked for the fields the report uses."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd

from draftsmith.benchmark.results import first_size_rows, verify_ratio
from draftsmith.extraction.shards import manifest_rebuild_hint
from draftsmith.io import InvalidJSONFileError, read_json, sha256_file

SUMMARY_FIELDS = ["prompts", "acceptance_length", "per_position_acceptance", "tokens_per_s", "speedup"]
PER_PROMPT_COLUMNS = ["variant", "backend", "method", "prompt_id", "category", "new_tokens", "target_forwards",
                      "acceptance_length", "tokens_per_s", "speedup"]
METRICS_COLUMNS = ["variant", "split", "epoch", "step", "loss"]
STATS_FIELDS = ["records_read", "records_kept", "records_skipped", "skipped_by_reason", "records_truncated",
                "tokens", "assistant_tokens", "seq_length"]
REGENERATE_FIELDS = ["records_read", "dropped_by_reason"]  # the `regenerate` section of a regenerated dataset's stats
ANSWER_CHECK_FIELDS = ["num_answers", "cut_at_max_new_tokens", "repetitive_answers"]  # optional in that section
# its `self_prompts` section, for a dataset of prompts the target wrote (draftsmith.generation.self_prompts)
SELF_PROMPTS_FIELDS = ["candidates", "dropped_by_reason", "beyond_num_prompts"]
MANIFEST_FIELDS = ["shard", "num_samples", "num_tokens", "device"]
TRAINING_DATA_FIELDS = ["data_fraction", "train_samples", "train_tokens", "val_samples"]



class ReportInputError(ValueError):
    """An input file the report cannot use; the message names the file and the field."""


def _require(record: dict, fields, where: str) -> None:
    missing = [f for f in fields if f not in record]
    if missing:
        raise ReportInputError(f"{where}: missing field(s) {', '.join(missing)}")


def _read_json(path, where_kind: str) -> dict:
    try:
        return read_json(path, rebuild=manifest_rebuild_hint(path) if where_kind == "shard manifest" else None)
    except InvalidJSONFileError as e:
        raise ReportInputError(f"cannot read {where_kind}: {e}") from e
    except OSError as e:
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


def _float(value) -> float:
    return math.nan if value is None else float(value)


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
                "tokens_per_drafted_round": m.get("tokens_per_drafted_round"),
                "tokens_per_s": m["tokens_per_s"],
                "speedup": m["speedup"],
                "decode_speedup": m.get("decode_speedup"),
                "lossless": m.get("lossless"),
                "mismatched_count": len(m.get("mismatched_prompts") or []),
                "max_divergence_gap": max((d["logit_gap"] for d in (m.get("divergences") or {}).values()
                                           if d and d.get("logit_gap") is not None), default=None),
                "cost_ratio": (m.get("step_costs") or {}).get("cost_ratio"),
                "ideal_speedup": m.get("ideal_speedup"),
                "verify_ratio": verify_ratio(m.get("step_costs")),
                "round_model_speedup": m.get("round_model_speedup"),
                # timing (draftsmith.benchmark.results): absent or null where one run was timed (the vLLM backend)
                "repeats": m.get("repeats") or 1,
                "time_spread": _float(m.get("time_spread")),
                "speedup_low": _float((m.get("speedup_range") or [None, None])[0]),
                "speedup_high": _float((m.get("speedup_range") or [None, None])[1]),
                "unrepeatable_count": len(m.get("unrepeatable_prompts") or []),
            })
    if not rows:
        raise ReportInputError("no benchmark summaries were given")
    return by_variant, pd.DataFrame(rows)


LATENCY = ("ttft_p50", "tpot_p50", "tpot_p90")  # per_batch_size's latency figures, in seconds (NaN where absent)


def load_batch_sizes(summaries: dict[str, dict]) -> pd.DataFrame:
    """One row per (variant, method, batch size) from each summary's per_batch_size (draftsmith.benchmark.results),
    with the method's pays_up_to, the requests' latency in ms, the share of the run's wall time in refills and, for a
    draft whose step costs were measured at that size (batch 1's: the method's own), the verification's and a draft
    step's cost over a target step's; a summary written without it counts as its one size (concurrency, else 1)."""
    rows = []
    for variant, summary in summaries.items():
        for method, m in summary["methods"].items():
            sizes = m.get("per_batch_size") or {str(summary.get("concurrency") or 1): m}
            for size, entry in sizes.items():
                costs = entry.get("step_costs") or (m.get("step_costs") if int(size) == 1 else None) or {}
                rows.append({"variant": variant, "backend": summary["backend"], "method": method,
                             "batch_size": int(size), "tokens_per_s": _float(entry.get("tokens_per_s")),
                             "speedup": _float(entry.get("speedup")),
                             "acceptance_length": _float(entry.get("acceptance_length")),
                             **{f"{key}_ms": 1000 * _float(entry.get(key)) for key in LATENCY},
                             "refill_share": _float(entry.get("refill_share")),
                             "verify_ratio": _float(verify_ratio(costs)), "cost_ratio": _float(costs.get("cost_ratio")),
                             "pays_up_to": m.get("pays_up_to")})
    columns = ["variant", "backend", "method", "batch_size", "tokens_per_s", "speedup", "acceptance_length",
               *(f"{key}_ms" for key in LATENCY), "refill_share", "verify_ratio", "cost_ratio", "pays_up_to"]
    return pd.DataFrame(rows, columns=columns)


def load_per_prompt(paths, variants) -> pd.DataFrame:
    """The per-prompt rows of each variant's smallest batch size, the size its summary's top-level figures are for (a
    sweep's rows at larger sizes have no per-request counters; draftsmith.report.load_batch_sizes reads those sizes)."""
    frames = []
    for path in paths:
        df = _read_csv(path, PER_PROMPT_COLUMNS)
        unknown = sorted(set(df["variant"]) - set(variants))
        if unknown:
            raise ReportInputError(f"{path}: column variant has {unknown}, which no benchmark summary describes")
        frames.append(first_size_rows(df))
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
    """One row per dataset (prepared stats.json). For a regenerated dataset (a `regenerate` section, copied from
    regenerate's stats) `records_read` is the records read from the raw data, and the prompts regenerate dropped
    before answering are `dropped_by_regenerate` (by reason in `dropped_by_regenerate_by_reason`), so that
    records read = dropped by regenerate + records skipped (by prepare) + records kept. For prompts the target wrote
    itself (source self: a `self_prompts` section in regenerate's) the records read are the candidates it wrote, and
    those its checks dropped, or that were not needed, are dropped too (reasons `self_prompts: <reason>`)."""
    rows = []
    for path in paths:
        stats = _read_json(path, "dataset stats")
        _require(stats, STATS_FIELDS, str(path))
        row = {"dataset": stats.get("dataset") or Path(path).parent.name, **{k: stats[k] for k in STATS_FIELDS}}
        regenerated = stats.get("regenerate")
        if regenerated is not None:
            _require(regenerated, REGENERATE_FIELDS, f"{path}: regenerate")
            row["records_read"] = regenerated["records_read"]
        dropped = dict((regenerated or {}).get("dropped_by_reason", {}))
        written = (regenerated or {}).get("self_prompts")
        if written is not None:
            _require(written, SELF_PROMPTS_FIELDS, f"{path}: regenerate: self_prompts")
            row["records_read"] = written["candidates"]
            dropped.update({f"self_prompts: {k}": v for k, v in written["dropped_by_reason"].items()})
            if written["beyond_num_prompts"]:
                dropped["self_prompts: beyond_num_prompts"] = written["beyond_num_prompts"]
        row["dropped_by_regenerate"] = sum(dropped.values())
        row["dropped_by_regenerate_by_reason"] = dropped
        # regenerate's answer checks (draftsmith.data.answer_checks); None where not regenerated or not recorded
        for key in ANSWER_CHECK_FIELDS:
            row[key] = (regenerated or {}).get(key)
        rows.append(row)
    columns = ["dataset", "records_read", "dropped_by_regenerate", "dropped_by_regenerate_by_reason",
               *[k for k in STATS_FIELDS if k != "records_read"], *ANSWER_CHECK_FIELDS]
    return pd.DataFrame(rows, columns=columns)


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


def load_training_data(paths) -> pd.DataFrame:
    """What each variant's draft was trained on (training_data.json beside its checkpoint)."""
    rows = []
    for path in paths:
        data = _read_json(path, "training data summary")
        _require(data, TRAINING_DATA_FIELDS, str(path))
        datasets = data.get("datasets")  # absent in summaries written before variants chose datasets
        rows.append({"variant": Path(path).parent.name, **{k: data[k] for k in TRAINING_DATA_FIELDS},
                     "datasets": ", ".join(datasets) if datasets else "all"})
    return pd.DataFrame(rows, columns=["variant", *TRAINING_DATA_FIELDS, "datasets"])
