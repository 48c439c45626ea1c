"""Hidden-state shards: speculators data-format-v1 files plus a manifest, written resumably.

A shard directory holds `data_{i}.pt` files (`input_ids`, `hidden_states` = list of four
`[seq, hidden]` tensors, `loss_mask`), `i` being the sample's index in the prepared
dataset, and `manifest.json`, written last. While a shard is being extracted,
`progress.jsonl` records each finished file with its checksum, so a killed job resumes
from its last completed sample; batches are planned from the whole shard, so a resumed
shard is byte-identical to an uninterrupted one.
"""

from __future__ import annotations

import io
import json
import logging
import os
import platform
import shutil
import threading
import time
from importlib import metadata
from pathlib import Path

import torch

from draftsmith.io import atomic_path, read_json, sha256_bytes, sha256_file, write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
JOURNAL = "progress.jsonl"
FORMAT = "speculators-data-v1"
NUM_STATES = 4


class ShardError(ValueError):
    """A shard that must not be used; the message names the shard, the file and the check."""


def package_versions(names=("torch", "transformers", "speculators", "vllm", "datasets", "snakemake", "draftsmith")) -> dict:
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
    if total <= 2 << 30:
        fingerprint["weights_sha256"] = {p.name: sha256_file(p) for p in weights}
    return fingerprint


def shard_indices(num_samples: int, num_shards: int, shard: int) -> list[int]:
    """Round-robin assignment of sample indices to shards (balanced, deterministic)."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
    return list(range(shard, num_samples, num_shards))


def sample_file(index: int) -> str:
    return f"data_{index}.pt"


def serialise_sample(input_ids: list[int], loss_mask: list[int], states: list[torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save(
        {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "hidden_states": states,
            "loss_mask": torch.tensor(loss_mask, dtype=torch.long),
        },
        buf,
    )
    return buf.getvalue()


class ShardWriter:
    """Writes sample files atomically and journals them, so an interrupted shard resumes."""

    def __init__(self, shard_dir: Path, plan: dict):
        self.dir = Path(shard_dir)
        self.plan = plan
        self.lock = threading.Lock()
        self.done: dict[int, dict] = {}
        self.dir.mkdir(parents=True, exist_ok=True)
        journal = self.dir / JOURNAL
        if journal.exists() and self._load_journal(journal):
            log.info("resuming shard %s: %d samples already written", self.dir, len(self.done))
        else:
            self._reset()
        self.journal = open(self.dir / JOURNAL, "a")

    def _load_journal(self, journal: Path) -> bool:
        lines = journal.read_text().splitlines()
        try:
            header = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if header != {"plan": self.plan}:
            log.info("shard %s was started with different inputs; starting over", self.dir)
            return False
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            path = self.dir / entry["file"]
            if path.exists() and sha256_file(path) == entry["sha256"]:
                self.done[entry["index"]] = entry
        return True

    def _reset(self):
        for p in self.dir.iterdir():
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
        with open(self.dir / JOURNAL, "w") as f:
            f.write(json.dumps({"plan": self.plan}, sort_keys=True) + "\n")

    def write(self, index: int, sample_id: str, data: bytes, num_tokens: int, num_loss_tokens: int):
        name = sample_file(index)
        with atomic_path(self.dir / name) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
        entry = {
            "index": index,
            "sample_id": sample_id,
            "file": name,
            "sha256": sha256_bytes(data),
            "bytes": len(data),
            "num_tokens": num_tokens,
            "num_loss_tokens": num_loss_tokens,
        }
        with self.lock:
            self.journal.write(json.dumps(entry, sort_keys=True) + "\n")
            self.journal.flush()
            self.done[index] = entry

    def finish(self, manifest: dict, expected: list[int]):
        self.journal.close()
        missing = [i for i in expected if i not in self.done]
        if missing:
            raise ShardError(f"{self.dir}: {len(missing)} samples were not written (first: {missing[:5]})")
        manifest["samples"] = [self.done[i] for i in expected]
        write_json(self.dir / MANIFEST, manifest)
        (self.dir / JOURNAL).unlink()

    def close(self):
        if not self.journal.closed:
            self.journal.close()


def extract_shard(
    samples: dict[str, list],
    samples_sha256: str,
    shard: int,
    num_shards: int,
    shard_dir: Path,
    extractor,
    batch_tokens: int,
    max_batch_size: int,
    model_info: dict,
    writers: int = 4,
) -> dict:
    """Extract one shard with an HF extractor; return its manifest."""
    from tqdm import tqdm

    from draftsmith.hidden_states import plan_batches, run_batches

    indices = shard_indices(len(samples["input_ids"]), num_shards, shard)
    plan = {
        "samples_sha256": samples_sha256,
        "shard": shard,
        "num_shards": num_shards,
        "layer_ids": extractor.aux_layer_ids + [-1],
        "model": model_info,
        "dtype": str(extractor.dtype),
        "batch_tokens": batch_tokens,
        "max_batch_size": max_batch_size,
    }
    if not indices:
        raise ShardError(f"{shard_dir}: shard {shard} of {num_shards} has no samples; lower extraction.num_shards")
    writer = ShardWriter(shard_dir, plan)
    try:
        lengths = [len(samples["input_ids"][i]) for i in indices]
        batches = [[indices[j] for j in b] for b in plan_batches(lengths, batch_tokens, max_batch_size)]
        todo = [b for b in batches if not all(i in writer.done for i in b)]
        resumed = sum(i in writer.done for i in indices)
        total_tokens = sum(lengths)
        done_tokens = sum(len(samples["input_ids"][i]) for b in batches if b not in todo for i in b)

        def on_sample(index, get_states):
            if index in writer.done:
                return
            ids, mask = samples["input_ids"][index], samples["loss_mask"][index]
            data = serialise_sample(ids, mask, get_states())
            writer.write(index, samples["sample_id"][index], data, len(ids), int(sum(mask)))

        start = time.perf_counter()
        with tqdm(total=total_tokens, initial=done_tokens, unit="tok", unit_scale=True, desc=f"shard {shard}", mininterval=5) as bar:
            run_batches(extractor, samples["input_ids"], todo, on_sample, writers=writers, progress=bar.update)
        seconds = time.perf_counter() - start
        new_tokens = total_tokens - done_tokens
        manifest = {
            "format": FORMAT,
            "shard": shard,
            "num_shards": num_shards,
            "backend": "hf",
            "layer_ids": plan["layer_ids"],
            "aux_layer_ids": extractor.aux_layer_ids,
            "layer_convention": "aux layer i = input of decoder layer i (HF hidden_states[i]); last = output of the final norm",
            "hidden_size": extractor.hidden_size,
            "num_states": NUM_STATES,
            "dtype": str(extractor.dtype).replace("torch.", ""),
            "model": model_info,
            "samples_sha256": samples_sha256,
            "num_samples": len(indices),
            "num_tokens": total_tokens,
            "device": device_description(extractor.device),
            "versions": package_versions(),
            "extraction_seconds": round(seconds, 3),
            "tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 else None,
            "resumed_samples": resumed,
        }
        writer.finish(manifest, indices)
    finally:
        writer.close()
    return manifest


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


# ----------------------------------------------------------------------------- validation


def load_manifest(shard_dir: str | Path) -> dict:
    path = Path(shard_dir) / MANIFEST
    if not path.exists():
        raise ShardError(f"{shard_dir}: no {MANIFEST}; the shard is unfinished or was not extracted")
    try:
        return read_json(path)
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: manifest is not valid JSON: {e}") from e


def validate_shard(shard_dir: str | Path, samples: dict[str, list] | None = None, deep: bool = True) -> dict:
    """Check a shard against its manifest; raise ShardError naming shard, file and check.

    Checks: every file exists with the recorded sha256; with `deep`, each file loads with
    the four states of shape [num_tokens, hidden] and the recorded dtype, finite, no
    all-zero layer, input_ids/loss_mask of the right length; with `samples` (the prepared
    dataset), the sample ids, their order and the token ids echo the input.
    """
    shard_dir = Path(shard_dir)
    manifest = load_manifest(shard_dir)
    entries = manifest.get("samples", [])
    if len(entries) != manifest.get("num_samples"):
        raise ShardError(f"{shard_dir}: sample count: manifest lists {len(entries)} files but num_samples={manifest.get('num_samples')}")
    expected_order = shard_indices(len(samples["input_ids"]), manifest["num_shards"], manifest["shard"]) if samples else None
    if expected_order is not None and [e["index"] for e in entries] != expected_order:
        raise ShardError(f"{shard_dir}: sample order: indices {[e['index'] for e in entries][:5]}... do not match the dataset's shard plan {expected_order[:5]}...")
    dtype = getattr(torch, manifest["dtype"])
    for entry in entries:
        path = shard_dir / entry["file"]
        where = f"{shard_dir}: {entry['file']}"
        if not path.exists():
            raise ShardError(f"{where}: missing file")
        if sha256_file(path) != entry["sha256"]:
            raise ShardError(f"{where}: checksum: sha256 differs from the manifest (file changed or corrupt)")
        if samples is not None:
            if samples["sample_id"][entry["index"]] != entry["sample_id"]:
                raise ShardError(f"{where}: sample id {entry['sample_id']!r} != dataset's {samples['sample_id'][entry['index']]!r}")
        if deep:
            check_sample(path, where, entry["num_tokens"], manifest["hidden_size"], dtype,
                         samples["input_ids"][entry["index"]] if samples is not None else None)
    return manifest


def check_sample(path: Path, where: str, num_tokens: int, hidden_size: int, dtype: torch.dtype, input_ids: list[int] | None):
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any load failure means a corrupt file
        raise ShardError(f"{where}: load: {type(e).__name__}: {e}") from e
    for key in ("input_ids", "hidden_states", "loss_mask"):
        if key not in data:
            raise ShardError(f"{where}: format: missing key {key!r}")
    states = data["hidden_states"]
    if len(states) != NUM_STATES:
        raise ShardError(f"{where}: format: {len(states)} hidden-state tensors, expected {NUM_STATES}")
    if data["input_ids"].shape != (num_tokens,) or data["loss_mask"].shape != (num_tokens,):
        raise ShardError(f"{where}: shape: input_ids/loss_mask length differs from num_tokens={num_tokens}")
    if input_ids is not None and data["input_ids"].tolist() != list(input_ids):
        raise ShardError(f"{where}: token ids: stored input_ids differ from the prepared sample")
    for layer, state in enumerate(states):
        if tuple(state.shape) != (num_tokens, hidden_size):
            raise ShardError(f"{where}: shape: hidden_states[{layer}] is {tuple(state.shape)}, expected ({num_tokens}, {hidden_size})")
        if state.dtype != dtype:
            raise ShardError(f"{where}: dtype: hidden_states[{layer}] is {state.dtype}, manifest says {dtype}")
        if not torch.isfinite(state).all():
            raise ShardError(f"{where}: finite: hidden_states[{layer}] contains NaN or Inf")
        if not state.abs().amax() > 0:
            raise ShardError(f"{where}: non-zero: hidden_states[{layer}] is all zeros")


def shard_files(manifest_paths: list[str | Path]) -> list[str]:
    """The sample files listed by the given manifests, in manifest order."""
    files = []
    for mp in manifest_paths:
        mp = Path(mp)
        manifest = read_json(mp)
        files += [str(mp.parent / e["file"]) for e in manifest["samples"]]
    return files
