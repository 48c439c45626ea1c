"""The target's config.json as preflight reads it (nothing else of the target is loaded), and the causal-LM model
types the installed transformers knows, read from its source."""

from __future__ import annotations

import ast
from pathlib import Path

from draftsmith.io import read_json
from draftsmith.vllm_stack import source


def read_target_config(target: str, revision: str | None = None, offline: bool = False) -> dict:
    """The target's config.json as a dict: from a local directory, or only that file from the hub (`offline`: from
    its cache only)."""
    path = Path(target) / "config.json"
    if not Path(target).is_dir():
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(target, "config.json", revision=revision, local_files_only=offline))
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return read_json(path, rebuild="the target model's files are damaged: download or import the model again")


def text_part(config: dict) -> dict:
    """The language model's part of a (possibly multimodal) config.json."""
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


def transformers_causal_lm_types() -> set[str]:
    """Model types transformers' AutoModelForCausalLM knows, read from its source."""
    tree = source.parse_module("transformers.models.auto.modeling_auto")
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" for t in node.targets):
            pairs = node.value.args[0] if isinstance(node.value, ast.Call) else node.value
            return {ast.literal_eval(e)[0] for e in pairs.elts}
    return set()
