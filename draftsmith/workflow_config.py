"""The workflow config outside Snakemake: the embedded default with user files merged on top,
the way Snakemake merges `--configfile` over the Snakefile's `configfile:`."""

from __future__ import annotations

from pathlib import Path

import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


def deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def load_config(paths: list[str | Path]) -> dict:
    config = yaml.safe_load(DEFAULT_CONFIG.read_text()) if DEFAULT_CONFIG.exists() else {}
    for path in paths:
        config = deep_merge(config, yaml.safe_load(Path(path).read_text()) or {})
    return config
