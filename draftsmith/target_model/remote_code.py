"""A target that ships its own Python code, and `target.trust_remote_code` off: draftsmith's own error, before transformers'.

A model directory whose config.json has `auto_map` names classes in Python files of the model repository; transformers
runs them only with `trust_remote_code=True`. Every load of the target (TargetSpec's loaders, the vLLM extraction
generator) checks a local directory first and raises RemoteCodeError naming the model and the config key; for a hub id,
transformers' own refusal is re-raised as the same error. Preflight reports the same message.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path


class RemoteCodeError(ValueError):
    """The target needs its repository's code and target.trust_remote_code is false."""


def remote_code_message(model: str, why: str | None = None) -> str:
    why = why or "its config.json has auto_map (classes defined by Python files in the model repository)"
    return (f"target {model}: {why}; transformers runs that code only with target.trust_remote_code: true, which is "
            "false in this config. Set target.trust_remote_code: true if you trust that repository (its code runs "
            "with the pipeline's permissions), or use a model that transformers supports without it")


def has_auto_map(model: str) -> bool:
    """Whether `model` is a local directory whose config.json has `auto_map` (a hub id: unknown here, False)."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # an unreadable config.json: the loader (or preflight) names that problem
    return isinstance(raw, dict) and "auto_map" in raw


def check_remote_code(model: str, trust_remote_code: bool) -> None:
    """Raise RemoteCodeError if the local target `model` ships code and trust_remote_code is off."""
    if not trust_remote_code and has_auto_map(model):
        raise RemoteCodeError(remote_code_message(model))


@contextmanager
def remote_code_checked(model: str, trust_remote_code: bool):
    """Around a transformers `from_pretrained` of the target: check a local directory first, and turn transformers'
    refusal of remote code (a hub id, or a tokenizer_config.json with auto_map) into RemoteCodeError."""
    check_remote_code(model, trust_remote_code)
    try:
        yield
    except ValueError as e:
        if trust_remote_code or "trust_remote_code=True" not in str(e):
            raise
        first = str(e).strip().splitlines()[0]
        raise RemoteCodeError(remote_code_message(model, f"transformers says: {first}")) from e
