"""The workflow config outside Snakemake: the embedded default with user files merged on top,
the way Snakemake merges `--configfile` over the Snakefile's `configfile:`."""

from __future__ import annotations

from pathlib import Path

import yaml

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "config" / "config.yaml"


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


def load_config(paths: list[str | Path]) -> dict:
    config = read_config_file(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else {}
    for path in paths:
        config = deep_merge(config, read_config_file(path))
    return config
