"""The workflow config: the embedded default with user files merged on top, as Snakemake merges
`--configfile` over the Snakefile's `configfile:`, checked strictly and validated against the schema,
which fills in every default (config/schema/config.schema.yaml is the only place defaults live).

Two differences from a plain deep merge, applied the same way by rules/common.smk and `load_config`:
a key given twice in one file is an error (YAML keeps the last silently), and the named sections
`datasets` and `variants` of the user's files replace the embedded default's instead of adding to
them (a config naming its own dataset must not also train on the synthetic corpus).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "config" / "config.yaml"
SCHEMA = REPO / "config" / "schema" / "config.schema.yaml"
NAMED_SECTIONS = ("datasets", "variants")


class ConfigError(ValueError):
    """A workflow config file that cannot be used as written."""


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{key_node.start_mark.name}: line {line}: key {key!r} is given twice "
                                  f"(first on line {seen[key]}); keep one of them")
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_config_file(path: str | Path) -> dict:
    """One workflow config file as a dict; a duplicate key is an error naming the file, the key and its lines."""
    with open(path, encoding="utf-8") as f:
        return yaml.load(f, Loader=StrictLoader) or {}


def deep_merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def user_files(paths) -> list[Path]:
    """The config files that are not the embedded default."""
    return [Path(p) for p in paths if Path(p).resolve() != DEFAULT_CONFIG.resolve()]


def replace_named_sections(config: dict, paths) -> dict:
    """`datasets` and `variants` as the user's files give them (merged across those files), where any does."""
    files = [read_config_file(p) for p in user_files(paths)]
    for key in NAMED_SECTIONS:
        given = [f[key] for f in files if key in f]
        if given:
            config[key] = functools.reduce(deep_merge, given, {})
    return config


def validate(config: dict) -> dict:
    """Check `config` against the schema and fill in its defaults (in place, as Snakemake's validate does)."""
    from snakemake.utils import validate as snakemake_validate

    snakemake_validate(config, str(SCHEMA))
    return config


def load_config(paths: list[str | Path]) -> dict:
    config = read_config_file(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else {}
    for path in paths:
        config = deep_merge(config, read_config_file(path))
    return validate(replace_named_sections(config, paths))


@functools.lru_cache(maxsize=None)
def _schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def section_defaults(section: str) -> dict:
    """The schema's defaults of one config section (e.g. "benchmark"), for code called outside the workflow."""
    props = _schema()["properties"][section]["properties"]
    return {key: copy.deepcopy(spec["default"]) for key, spec in props.items() if "default" in spec}
