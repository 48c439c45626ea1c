"""What produced an output: package versions, the target model's fingerprint, the device."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from pathlib import Path

from draftsmith.io import sha256_file

PIPELINE_PACKAGES = ("torch", "transformers", "speculators", "vllm", "datasets", "snakemake", "draftsmith")
# weight files up to this size are hashed; larger targets are identified by config hash and total size
HASH_WEIGHTS_UP_TO = 2 << 30
# what, besides config and weights, decides the target's tokens and answers
MODEL_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "chat_template.jinja", "draftsmith_provenance.json")


def package_versions(names=PIPELINE_PACKAGES) -> dict:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    versions["python"] = platform.python_version()
    return versions


def model_fingerprint(model_path: str | Path) -> dict:
    """Identify a target model: its config, and its weight files (hashed when small, sized otherwise)."""
    path = Path(model_path)
    if not path.is_dir():
        return {"path": str(model_path), "config_sha256": None}
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    total = sum(p.stat().st_size for p in weights)
    fingerprint = {
        "path": str(model_path),
        "config_sha256": sha256_file(path / "config.json"),
        "weights_bytes": total,
    }
    if total <= HASH_WEIGHTS_UP_TO:
        fingerprint["weights_sha256"] = {p.name: sha256_file(p) for p in weights}
    fingerprint["files_sha256"] = {n: sha256_file(path / n) for n in MODEL_FILES if (path / n).is_file()}
    return fingerprint


def same_model(recorded: dict, current: dict) -> bool:
    """Whether a recorded fingerprint (in a manifest or train state) is the current target's."""
    if recorded.get("config_sha256") != current.get("config_sha256"):
        return False
    if "files_sha256" in current and recorded.get("files_sha256") != current["files_sha256"]:
        return False
    return "weights_sha256" not in current or recorded.get("weights_sha256") == current["weights_sha256"]


def device_description(device) -> str:
    """`cuda: <GPU name>` or `cpu: <processor> (<n> cores)` for a torch.device."""
    if device.type == "cuda":
        import torch

        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted keys in which two fingerprints differ, for a log line that says what changed."""
    keys = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a != b:
            nested = isinstance(a, dict) and isinstance(b, dict)
            keys += changed_keys(a, b, f"{prefix}{key}.") if nested else [prefix + key]
    return keys
