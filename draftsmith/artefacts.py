"""Every output the workflow makes for a config, by the rule that makes it (the paths rules/*.smk declare).

Rule `all` asks for all of them, because Snakemake 9 rebuilds a deleted intermediate only when a job after it must
run: listed there, a deleted vocab map or shard is rebuilt by a plain `snakemake`, and what depends on it re-runs.
`snakemake validate` and `draftsmith validate` require each of them.
"""

from __future__ import annotations

from pathlib import Path

# Targets the workflow makes itself into <results>/target, and the rule that makes each.
BUILT_TARGETS = {"embedded": "build_target", "smollm2-135m-instruct": "import_target"}
DRAFT_FILES = ("config.json", "model.safetensors", "metrics.csv", "training_data.json")
BENCHMARK_FILES = ("per_prompt.csv", "summary.json")


def uses_synthetic_corpus(config: dict) -> bool:
    """Whether a job reads the generated corpus: a synthetic dataset, the embedded target's pretraining, or the
    held-out benchmark prompts."""
    return (config["target"]["model"] == "embedded" or config["benchmark"]["prompts"] == "heldout"
            or any(spec["source"] == "synthetic" for spec in config["datasets"].values()))


def shard_manifests(config: dict, dataset: str) -> list[Path]:
    shards = Path(config["results"]) / "shards" / dataset
    return [shards / f"shard_{k}" / "manifest.json" for k in range(config["extraction"]["num_shards"])]


def variant_datasets(config: dict, variant: str) -> list[str]:
    """The datasets a variant trains on: its `datasets`, else every dataset."""
    names = config["variants"][variant].get("datasets") or config["datasets"]
    return [d for d in sorted(config["datasets"]) if d in names]


# the extraction keys that set the hidden states when train_draft computes them (training.hidden_states: online)
ONLINE_SETTINGS = ("aux_layer_ids", "dtype", "batch_tokens", "max_batch_size")


def online_states(config: dict) -> bool:
    """training.hidden_states: online computes the states in train_draft, and no shard is written."""
    return config.get("training", {}).get("hidden_states", "offline") == "online"


def variant_manifests(config: dict, variant: str) -> list[Path]:
    """The shards a variant trains on (none online)."""
    if online_states(config):
        return []
    return [m for d in variant_datasets(config, variant) for m in shard_manifests(config, d)]


def variant_samples(config: dict, variant: str) -> list[Path]:
    """The prepared samples an online variant trains on (none offline: the shards carry them)."""
    if not online_states(config):
        return []
    return [Path(config["results"]) / "prepared" / d / "samples.parquet" for d in variant_datasets(config, variant)]


def variant_states_inputs(config: dict, variant: str) -> list[Path]:
    """The files a variant's hidden states come from: its shard manifests offline, its prepared samples online."""
    return variant_samples(config, variant) if online_states(config) else variant_manifests(config, variant)


def offline_reference(config: dict) -> bool:
    return config["benchmark"]["backend"] == "vllm" and config["benchmark"]["offline_reference"]


def expected_outputs(config: dict) -> dict[str, list[Path]]:
    """rule name -> the outputs its jobs make for `config` (a validated workflow config)."""
    r = Path(config["results"])
    datasets, variants = sorted(config["datasets"]), sorted(config["variants"])
    out: dict[str, list[Path]] = {}
    if uses_synthetic_corpus(config):
        out["make_synthetic_corpus"] = [r / "data" / "synthetic" / "train.jsonl", r / "data" / "synthetic" / "heldout.jsonl"]
    if config["target"]["model"] in BUILT_TARGETS:
        out[BUILT_TARGETS[config["target"]["model"]]] = [r / "target"]
    written = [d for d in datasets if config["datasets"][d]["source"] == "self"]
    if written:
        out["self_prompts"] = [r / "data" / "self" / f"{d}{ext}" for d in written for ext in (".jsonl", ".stats.json")]
    regenerated = [d for d in datasets if config["datasets"][d]["regenerate"]]
    if regenerated:
        out["regenerate"] = [r / "data" / "regenerated" / f"{d}{ext}" for d in regenerated for ext in (".jsonl", ".stats.json")]
    out["prepare_dataset"] = [r / "prepared" / d / name for d in datasets for name in ("samples.parquet", "stats.json")]
    out["token_freq"] = [r / "vocab" / d / "token_freq.pt" for d in datasets]
    out["vocab_map"] = [r / "vocab" / name for name in ("token_freq.pt", "d2t.npy", "t2d.npy")]
    if not online_states(config):
        out["extract_hidden_states"] = [m for d in datasets for m in shard_manifests(config, d)]
    out["train_draft"] = [r / "draft" / v / name for v in variants for name in DRAFT_FILES]
    out["benchmark_prompts"] = [r / "benchmark" / "prompts.jsonl"]
    out["benchmark"] = [r / "benchmark" / v / name for v in variants for name in BENCHMARK_FILES]
    if offline_reference(config):
        out["benchmark_offline_reference"] = [r / "benchmark" / v / "offline" / name for v in variants
                                              for name in BENCHMARK_FILES]
    out["report"] = [r / "report" / "report.html", r / "report" / "report.md", r / "report" / "learning_curve.csv",
                     r / "report" / "figures"]
    return out


def job_benchmark_files(config: dict) -> list[str]:
    """The benchmark files (relative to <results>/benchmarks) of the config's jobs that have wildcards: a file of a
    variant renamed away, a dataset removed or a shard beyond num_shards is not among them."""
    datasets, variants = sorted(config["datasets"]), sorted(config["variants"])
    files = [f"{rule}/{d}.tsv" for rule in ("prepare_dataset", "token_freq") for d in datasets]
    files += [f"{rule}/{d}.tsv" for rule in ("self_prompts", "regenerate") for d in datasets]
    if not online_states(config):
        files += [f"extract_hidden_states/{d}/shard_{k}.tsv" for d in datasets
                  for k in range(config["extraction"]["num_shards"])]
    files += [f"{rule}/{v}.tsv" for rule in ("train_draft", "benchmark") for v in variants]
    return files + [f"benchmark/{v}.offline_reference.tsv" for v in variants]


def target_model(config: dict) -> str:
    """The target every stage loads: <results>/target when the workflow builds it, else target.model."""
    if config["target"]["model"] in BUILT_TARGETS:
        return str(Path(config["results"]) / "target")
    return config["target"]["model"]
