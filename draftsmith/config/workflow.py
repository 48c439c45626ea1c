"""The workflow config outside Snakemake: the embedded default with user files merged on top, the way
Snakemake merges `--configfile` over the Snakefile's `configfile:`, then validated against the schema,
which fills in every default (config/schema/config.schema.yaml is the only place defaults live)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "config" / "config.yaml"
SCHEMA = REPO / "config" / "schema" / "config.schema.yaml"


def deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def validate(config: dict) -> dict:
    """Check `config` against the schema and fill in its defaults (in place, as Snakemake's validate does)."""
    from snakemake.utils import validate as snakemake_validate

    snakemake_validate(config, str(SCHEMA))
    return config


def load_config(paths: list[str | Path]) -> dict:
    config = yaml.safe_load(DEFAULT_CONFIG.read_text()) if DEFAULT_CONFIG.exists() else {}
    for path in paths:
        config = deep_merge(config, yaml.safe_load(Path(path).read_text()) or {})
    return validate(config)


@functools.lru_cache(maxsize=None)
def _schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def section_defaults(section: str) -> dict:
    """The schema's defaults of one config section (e.g. "benchmark"), for code called outside the workflow."""
    props = _schema()["properties"][section]["properties"]
    return {key: copy.deepcopy(spec["default"]) for key, spec in props.items() if "default" in spec}
