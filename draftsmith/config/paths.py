"""The paths a workflow config names (datasets.<name>.path, benchmark.prompts.path, a target directory): a relative
one resolves against the folder of the config file that sets it, and each must exist and be readable when the config
is checked, before any job starts. Unchecked, a missing dataset file surfaced as Snakemake's MissingInputException
naming neither key nor file, and a missing target directory as HFValidationError a minute into the run."""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.artefacts import BUILT_TARGETS


def path_keys(config: dict) -> list[tuple[tuple, str, str]]:
    """(key path, value, kind) of each path in `config`: kind "file" (a local dataset or prompt file) or "target"
    (target.model, unless the workflow builds it; whether it is a directory or a hub id: is_directory)."""
    found = []
    datasets = config.get("datasets")
    for name, spec in (datasets if isinstance(datasets, dict) else {}).items():
        if isinstance(spec, dict) and spec.get("source") == "local" and isinstance(spec.get("path"), str):
            found.append((("datasets", name, "path"), spec["path"], "file"))
    bench = config.get("benchmark")
    prompts = bench.get("prompts") if isinstance(bench, dict) else None
    if isinstance(prompts, dict) and prompts.get("source") == "local" and isinstance(prompts.get("path"), str):
        found.append((("benchmark", "prompts", "path"), prompts["path"], "file"))
    target = config.get("target")
    model = target.get("model") if isinstance(target, dict) else None
    if isinstance(model, str) and model and model not in BUILT_TARGETS:
        found.append((("target", "model"), model, "target"))
    return found


def is_directory(model: str, folder: Path) -> bool:
    """Whether target.model names a directory rather than a hub id (`org/name`): an absolute path, one starting with
    . or ~, one of more than two parts, or a directory that exists beside the config file."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or (folder / model).is_dir()


def resolve_paths(config: dict, sources: list[tuple[str, dict]]) -> list[str]:
    """Make each relative path of `config` absolute against the folder of the file (of `sources`: (file name, its
    contents) in merge order, as config.workflow.config_sources gives them) that sets it, in place; one line per
    path resolved, saying so."""
    notes = []
    for key, value, kind in path_keys(config):
        source = Path(setting_file(key, sources)).resolve()
        if kind == "target" and not is_directory(value, source.parent):
            continue
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = Path(os.path.normpath(source.parent / path))
            notes.append(f"{'.'.join(key)}: {value} resolved against {source.parent} (the folder of {source.name})")
        *parents, last = key
        node = config
        for part in parents:
            node = node[part]
        node[last] = str(path)
    return notes


def path_problems(config: dict) -> list[tuple[tuple, str]]:
    """(key path, problem) of each path in `config` that does not exist or cannot be read."""
    problems = []
    for key, value, kind in path_keys(config):
        path = Path(value).expanduser()
        if kind == "target":
            if not is_directory(value, Path.cwd()):
                continue  # a hub id: checked when it is downloaded
            config_json = path / "config.json"
            if not path.is_dir():
                problem = f"target directory {path} does not exist" if not path.exists() else f"{path} is not a directory"
            elif not config_json.is_file():
                problem = f"{path} has no config.json: not a model directory"
            elif not os.access(config_json, os.R_OK):
                problem = f"{config_json} is not readable (permissions)"
            else:
                continue
        elif not path.exists():
            problem = f"{path} does not exist"
        elif path.is_dir():
            problem = f"{path} is a directory; give a .jsonl, .json or .parquet file"
        elif not os.access(path, os.R_OK):
            problem = f"{path} is not readable (permissions)"
        else:
            continue
        problems.append((key, problem))
    return problems

def setting_file(path: tuple, sources: list[tuple[str, dict]]) -> str:
    """The last file that sets the longest leading part of `path` (the last file where none does)."""
    best, depth = (sources[-1][0] if sources else "config"), 0
    for name, node in sources:
        found = 0
        for key in path:
            if isinstance(node, dict) and key in node:
                node, found = node[key], found + 1
            elif isinstance(node, list) and isinstance(key, int) and key < len(node):
                node, found = node[key], found + 1
            else:
                break
        if found and found >= depth:
            best, depth = name, found
    return best
