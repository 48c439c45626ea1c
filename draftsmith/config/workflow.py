"""The workflow config: the embedded default with user files merged on top, as Snakemake merges
`--configfile` over the Snakefile's `configfile:`, checked strictly and validated against the schema,
which fills in every default (config/schema/config.schema.yaml is the only place defaults live).

Differences from Snakemake's own reading, applied the same way by rules/common.smk (which rebuilds
Snakemake's `config` from the files with `merge_files`) and `load_config`:
- a key given twice in one file is an error (YAML keeps the last silently);
- `1e-3`, `1E5`, `-2e-4` are numbers (YAML 1.1, so PyYAML, reads a float without a dot or with an
  unsigned exponent as a string); a quoted "1e-3" stays a string, which a number key rejects;
- layering, whatever the order of the files: a later file's scalar replaces, a plain section merges key by key,
  a list replaces, and the named maps `datasets` and `variants` replace the earlier files' whole map (a config
  naming its own dataset must not also train on the synthetic corpus of config/tiny.yaml or the default);
- relative paths (datasets.<name>.path, benchmark.prompts.path, a target directory) resolve against the folder
  of the file that sets them (draftsmith.config.paths), which also checks each path exists;
- `check_config` reports every problem as one line naming the file, the key path and, for an unknown
  key, the nearest valid one; NaN and Inf are rejected anywhere; an integral float (`2.0`) where the
  schema says integer is turned into the int, a non-integral one (`2.5`) is an error.
"""

from __future__ import annotations

import copy
import difflib
import functools
import math
import re
from pathlib import Path

import yaml

from draftsmith.config.paths import path_problems, resolve_paths, setting_file

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


# YAML 1.2's exponent floats that YAML 1.1 reads as strings: no dot (1e-3, 1E5) or an unsigned exponent (1.5e3).
StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_config_file(path: str | Path) -> dict:
    """One workflow config file as a dict; a duplicate key is an error naming the file, the key and its lines."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=StrictLoader)
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except yaml.MarkedYAMLError as e:
        raise ConfigError(f"{path}: line {e.problem_mark.line + 1}: {e.problem}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys, not {type(data).__name__}")
    return data or {}


def deep_merge(base, override):
    """`override` over `base`, mappings merged key by key; any other value replaces."""
    if not (isinstance(base, dict) and isinstance(override, dict)):
        return override
    merged = dict(base)
    for key, value in override.items():
        merged[key] = deep_merge(merged.get(key), value) if key in merged else value
    return merged


def user_files(paths, default: Path = DEFAULT_CONFIG) -> list[Path]:
    """The config files that are not the embedded default."""
    return [Path(p) for p in paths if Path(p).resolve() != Path(default).resolve()]


def merge_files(paths, overrides: dict | None = None, default: Path = DEFAULT_CONFIG) -> dict:
    """The embedded default, then each of the user's files in `paths` in order, read strictly, then `overrides`
    (Snakemake's --config entries); a file that lists `datasets` or `variants` replaces the whole map of the files
    before it (deep_merge does the rest). `default`: the workflow's own config/config.yaml (a copy of the workflow,
    as a Kubernetes run makes, has its own), whatever its place in `paths`."""
    config = read_config_file(default) if Path(default).exists() else {}
    for data in (read_config_file(p) for p in user_files(paths, default)):
        config = deep_merge(config, data)
        config.update({key: data[key] for key in NAMED_SECTIONS if key in data})
    return deep_merge(config, overrides or {})


def validate(config: dict) -> dict:
    """Check `config` against the schema and fill in its defaults (in place, as Snakemake's validate does)."""
    from snakemake.utils import validate as snakemake_validate

    snakemake_validate(config, str(SCHEMA))
    return config


def load_config(paths: list[str | Path]) -> dict:

    config = merge_files(paths)
    resolve_paths(config, config_sources(paths))
    problems = check_config(config, paths)
    if problems:
        raise ConfigError("\n".join(problems))
    return validate(config)


def config_sources(files) -> list[tuple[str, dict]]:
    """(file name, its contents) of the embedded default and each of the user's `files`, in merge order."""
    return [(str(p), read_config_file(p)) for p in [*([DEFAULT_CONFIG] if DEFAULT_CONFIG.exists() else []),
                                                    *user_files(files)]]


@functools.lru_cache(maxsize=None)
def _schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


@functools.lru_cache(maxsize=None)
def _validator():
    """The schema's validator, where "integer" is an int only (jsonschema also takes 2.0, which then fails in
    range() or torch naming no key); check_config turns such a float into the int."""
    from jsonschema import Draft202012Validator, validators

    checker = Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool))
    return validators.extend(Draft202012Validator, type_checker=checker)(_schema())


def check_config(config: dict, files) -> list[str]:
    """Every problem of the merged `config` as one line `<file>: <key path>: <problem>`, the file being the last of
    `files` (and the embedded default) that sets the key. An integral float where the schema says integer is
    replaced by the int in `config` (not a problem). Defaults are not filled in (`validate` does that)."""
    sources = config_sources(files)
    problems = [(path, f"{_yaml_float(value)} is not a finite number") for path, value in _leaves(config)
                if isinstance(value, float) and not math.isfinite(value)]
    errors = list(_validator().iter_errors(config))
    integral = list(_integral_floats(errors))
    for path in integral:
        *parents, last = path
        node = functools.reduce(lambda n, k: n[k], parents, config)
        node[last] = int(node[last])
    if integral:
        errors = list(_validator().iter_errors(config))
    for e in errors:
        if not (isinstance(e.instance, float) and not math.isfinite(e.instance)):  # reported above
            problems += _describe(e)
    problems += _between_keys(config)
    problems += path_problems(config)
    lines = [f"{setting_file(path, sources)}: {_key(path)}: {problem}" for path, problem in problems]
    return list(dict.fromkeys(lines))


def _between_keys(config: dict) -> list[tuple[tuple, str]]:
    """Problems the schema cannot say in one line: a dataset of prompts without replies that is not regenerated,
    self_prompts.min_words above max_words, benchmark.batch_sizes out of order or beside concurrency or batch_size
    (draftsmith.config.batch_sizes)."""
    from draftsmith.config.batch_sizes import batch_size_problems
    from draftsmith.config.sources import PROMPT_SETS

    problems = []
    datasets = config.get("datasets")
    for name, spec in (datasets if isinstance(datasets, dict) else {}).items():
        source = spec.get("source") if isinstance(spec, dict) else None
        if (source in PROMPT_SETS or source == "self") and spec.get("regenerate") is not True:
            problems.append((("datasets", name), f"source {source} holds prompts without replies; set regenerate: true "
                                                 "(the target answers them)"))
    bench = config.get("benchmark")
    if isinstance(bench, dict):
        problems += [(("benchmark", key), problem) for key, problem in batch_size_problems(bench)]
    section = config.get("self_prompts")
    if isinstance(section, dict):
        low, high = section.get("min_words", 3), section.get("max_words", 300)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append((("self_prompts", "min_words"), f"{low} is above self_prompts.max_words ({high})"))
    return problems


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, i))
    else:
        yield path, value


def _yaml_float(value: float) -> str:
    return ".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf"


def _integral_floats(errors):
    """Key paths of the integral floats given where the schema says integer (also inside oneOf's branches)."""
    for e in errors:
        types = e.validator_value if isinstance(e.validator_value, list) else [e.validator_value]
        if e.validator == "type" and "integer" in types and isinstance(e.instance, float) and e.instance.is_integer():
            yield tuple(e.absolute_path)
        yield from _integral_floats(e.context)


TYPE_NAMES = {"object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
              "number": "a number", "boolean": "true or false", "null": "null"}


def _describe(e) -> list[tuple[tuple, str]]:
    """One (key path, problem) per problem of a jsonschema error."""
    path = tuple(e.absolute_path)
    if e.validator == "additionalProperties" and e.validator_value is False:
        props = e.schema.get("properties", {})
        return [((*path, key), f"unknown key; {_nearest(key, props)}") for key in e.instance if key not in props]
    if e.validator == "required":
        return [((*path, key), "is required") for key in e.validator_value if key not in e.instance]
    if e.validator == "type":
        types = e.validator_value if isinstance(e.validator_value, list) else [e.validator_value]
        expected = " or ".join(TYPE_NAMES.get(t, t) for t in types)
        if e.instance is None:
            return [(path, f"is empty (null); expected {expected}")]
        quoted = isinstance(e.instance, str) and {"number", "integer"} & set(types) and _is_float(e.instance)
        hint = " (a quoted number is a string: remove the quotes)" if quoted else ""
        return [(path, f"{e.instance!r} is not {expected}{hint}")]
    message = " or ".join(dict.fromkeys(c.message for c in e.context)) if e.context else e.message
    message = " ".join(message.split())
    return [(path, message if len(message) <= 200 else message[:197] + "...")]


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _nearest(key, props: dict) -> str:
    """`did you mean 'X'?` by spelling, else by a property whose description has the key's words
    (learning_rate: lr, "AdamW learning rate."), else the valid keys."""
    close = difflib.get_close_matches(str(key), list(props), n=1)
    phrase = str(key).replace("_", " ").lower()
    close = close or [p for p, spec in props.items() if phrase in str(spec.get("description", "")).lower()][:1]
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(props)}"


def _key(path: tuple) -> str:
    text = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
    return text or "(top level)"




def section_defaults(section: str) -> dict:
    """The schema's defaults of one config section (e.g. "benchmark"), for code called outside the workflow."""
    props = _schema()["properties"][section]["properties"]
    return {key: copy.deepcopy(spec["default"]) for key, spec in props.items() if "default" in spec}
