"""What produced an output: package versions, the target model's fingerprint, the device."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path

from draftsmith.io import read_json, sha256_bytes, sha256_file, write_json

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


# --- the target's content as Snakemake sees it while it builds the DAG ---------------------------------------------

FILES_RECORD = ".draftsmith_files.json"


def record_files(directory: str | Path) -> None:
    """Record a directory's files by content as its rule wrote them (the last write of a rule that builds a target)."""
    from draftsmith.fingerprints import ContentHashes

    write_json(Path(directory) / FILES_RECORD, ContentHashes().directory(directory))


def hub_cache_commit(repo_id: str, revision: str | None) -> str | None:
    """The commit the local hub cache resolves `revision` (default main) of a model to, without any network."""
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
    ref = Path(cache) / f"models--{repo_id.replace('/', '--')}" / "refs" / (revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def target_content(model: str, revision: str | None, built: bool, hashes) -> str:
    """The target's content, computed while Snakemake builds the DAG and handed to every rule that loads the target, so
    that a target whose bytes change in place re-runs them, and one merely touched or copied re-runs nothing.
    `hashes`: a draftsmith.fingerprints.ContentHashes (cached by size, mtime, inode and ctime).

    A target the workflow builds is "as built" while its files hold what its rule recorded (or before it exists): a
    rebuild re-runs what depends on it through the file dependency already. A local directory is a digest of its
    files' digests; a hub id, the commit the local hub cache resolves its revision to."""
    path = Path(model)
    if not path.is_dir():
        return f"hub commit {hub_cache_commit(model, revision)}" if not built else "as built"
    digests = hashes.directory(path)
    record = path / FILES_RECORD
    if built and record.is_file() and json.loads(record.read_text()) == digests:
        return "as built"
    return "files " + sha256_bytes(json.dumps(digests, sort_keys=True).encode())[:16]


# --- what a draft and a benchmark were made from (recorded in them; `validate` compares it with the results tree) ---


def samples_list_sha256(manifest: dict) -> str:
    """A shard by its sample list (each file's sha256 and length), not by the whole manifest, whose timing fields
    change when a shard is extracted again to the same bytes."""
    return sha256_bytes(json.dumps(manifest["samples"], sort_keys=True).encode())


def draft_inputs(states_files, d2t, t2d, target_fingerprint: dict) -> dict:
    """What the hidden states came from (offline: each shard manifest's sample list, its files' checksums; online:
    each prepared-samples file's checksum), the vocab map's checksums and the target's fingerprint."""
    states_files = [Path(p) for p in states_files]
    if any(p.suffix == ".parquet" for p in states_files):
        states = {"samples": {str(p): sha256_file(p) for p in states_files}}
    else:
        states = {"shards": {str(m): samples_list_sha256(read_json(m)) for m in states_files}}
    return {**states, "d2t_sha256": sha256_file(d2t), "t2d_sha256": sha256_file(t2d), "target": target_fingerprint}


def benchmark_inputs(draft_dir, prompts, target_fingerprint: dict) -> dict:
    """The draft's files, the prompt set and the target, by checksum."""
    draft = Path(draft_dir)
    return {"draft_config_sha256": sha256_file(draft / "config.json"),
            "draft_weights_sha256": sha256_file(draft / "model.safetensors"),
            "prompts_sha256": sha256_file(prompts), "target": target_fingerprint}


def record_inputs(path, inputs: dict) -> None:
    """Add `inputs` (as read when the job started) to a JSON output its job wrote."""
    write_json(path, {**read_json(path), "inputs": json.loads(json.dumps(inputs, default=str))})


# --- what each job read and wrote, by content (written when it finishes; `validate` follows the chain) ---------------

JOBS_DIR = "jobs"


def tree_key(path: str | Path, results: Path) -> str:
    """A path as a job record names it: relative to the results tree when inside it (a moved or copied tree keeps its
    records), else absolute."""
    real, root = Path(os.path.realpath(path)), Path(os.path.realpath(results))
    return str(real.relative_to(root)) if real.is_relative_to(root) else str(real)


def job_record_path(results: Path, first_output: str | Path) -> Path:
    from draftsmith.fingerprints import STATE_DIR

    return results / STATE_DIR / JOBS_DIR / f"{tree_key(first_output, results)}.json"


def record_job(rule: str, inputs, outputs, results: str | Path) -> None:
    """The sha256 of every input a job read and every output it wrote (a directory output file by file), in
    <results>/.draftsmith/jobs/<its first output>.json."""
    from draftsmith.fingerprints import ContentHashes

    results = Path(results)
    outputs = [str(p) for p in outputs]
    if not outputs:
        return
    hashes = ContentHashes(results)
    record = {
        "rule": rule,
        "inputs": {tree_key(p, results): hashes.fingerprint(p) for p in dict.fromkeys(map(str, inputs))},
        "outputs": {tree_key(p, results): hashes.directory(p) if Path(p).is_dir() else hashes.fingerprint(p)
                    for p in outputs},
    }
    write_json(job_record_path(results, outputs[0]), record)
    hashes.save()


def job_records(results: str | Path) -> list[dict]:
    from draftsmith.fingerprints import STATE_DIR

    root = Path(results) / STATE_DIR / JOBS_DIR
    return [read_json(p) for p in sorted(root.rglob("*.json"))] if root.is_dir() else []
