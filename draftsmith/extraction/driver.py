"""The extraction driver: one shard, any backend.

The driver owns everything that is not the model: which samples belong to the shard, the
journal that lets a killed job resume (`progress.jsonl`, one line per written file with its
checksum, under a header that fingerprints the inputs), progress, the manifest (written last)
and the final validation. A backend supplies only the hidden states of each batch:

    name: str                           "hf", "vllm", ...
    aux_layer_ids: list[int]            captured: the inputs of these decoder layers, then the final norm's output
    settings: dict                      what else determines its states (goes into the journal header and manifest)
    plan_batches(lengths) -> [[pos]]    deterministic grouping of the shard's samples (positions into `lengths`)
    extract(batches, token_ids, on_sample, progress)
        calls on_sample(index, seen_ids, get_states) once per sample of `batches` (any thread);
        seen_ids are the token ids the model saw (None: the input's); progress(n_tokens) per batch
    device() -> str                     where it ran, for the manifest
    close()                             frees the model

Batches are planned from the whole shard, so a resumed shard is byte-identical to an uninterrupted one.
A new backend is one module with a class of this shape, registered in BACKENDS.
"""

from __future__ import annotations

import importlib
import json
import logging
import shutil
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

from draftsmith.data.tokenization import read_samples
from draftsmith.extraction.shards import (
    FORMAT,
    JOURNAL,
    MANIFEST,
    NUM_STATES,
    ShardError,
    check_states,
    sample_file,
    serialise_sample,
    shard_indices,
    validate_shard,
)
from draftsmith.io import atomic_path, sha256_bytes, sha256_file, write_json
from draftsmith.provenance import package_versions
from draftsmith.target_model.layers import LAYER_CONVENTION, resolve_aux_layer_ids
from draftsmith.target_model.spec import TargetSpec

log = logging.getLogger(__name__)

# backend name -> "module:class"; imported only when chosen (the vllm backend imports vLLM)
BACKENDS = {
    "hf": "draftsmith.extraction.hf_backend:HFBackend",
    "vllm": "draftsmith.extraction.vllm_backend:VllmBackend",
}


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


def extract_shard(samples: dict[str, list], samples_sha256: str, shard: int, num_shards: int, shard_dir: Path,
                  backend, model_info: dict) -> dict:
    """Extract one shard of `samples` with `backend`; return its manifest."""
    indices = shard_indices(len(samples["input_ids"]), num_shards, shard)
    if not indices:
        raise ShardError(f"{shard_dir}: shard {shard} of {num_shards} has no samples; lower extraction.num_shards")
    lengths = [len(samples["input_ids"][i]) for i in indices]
    batches = [[indices[j] for j in b] for b in backend.plan_batches(lengths)]
    layer_ids = list(backend.aux_layer_ids) + [-1]
    plan = {"samples_sha256": samples_sha256, "shard": shard, "num_shards": num_shards, "backend": backend.name,
            "layer_ids": layer_ids, "model": model_info, **backend.settings}
    writer = ShardWriter(shard_dir, plan)
    try:
        todo = [b for b in batches if not all(i in writer.done for i in b)]
        resumed = sum(i in writer.done for i in indices)
        total_tokens = sum(lengths)
        done_tokens = total_tokens - sum(len(samples["input_ids"][i]) for b in todo for i in b)

        def on_sample(index, seen_ids, get_states):
            if index in writer.done:
                return
            ids, mask = samples["input_ids"][index], samples["loss_mask"][index]
            where = f"{shard_dir}: {sample_file(index)} (sample {samples['sample_id'][index]!r})"
            # checked here, in memory, rather than by reading every file back once the shard is written
            if seen_ids is not None and list(seen_ids) != list(ids):
                raise ShardError(f"{where}: token ids: the model saw other token ids than the prepared sample's")
            states = get_states()
            check_states(states, where, len(ids), dtype=states[0].dtype)
            data = serialise_sample(ids, mask, states)
            writer.write(index, samples["sample_id"][index], data, len(ids), int(sum(mask)))

        start = time.perf_counter()
        with tqdm(total=total_tokens, initial=done_tokens, unit="tok", unit_scale=True, desc=f"shard {shard}",
                  mininterval=5) as bar:
            if todo:
                backend.extract(todo, samples["input_ids"], on_sample, bar.update)
        seconds = time.perf_counter() - start
        new_tokens = total_tokens - done_tokens
        first = torch.load(Path(shard_dir) / writer.done[indices[0]]["file"], weights_only=True, map_location="cpu")
        manifest = {
            "format": FORMAT,
            "shard": shard,
            "num_shards": num_shards,
            "backend": backend.name,
            "layer_ids": layer_ids,
            "aux_layer_ids": list(backend.aux_layer_ids),
            "layer_convention": LAYER_CONVENTION,
            "hidden_size": first["hidden_states"][0].shape[-1],
            "num_states": NUM_STATES,
            "dtype": str(first["hidden_states"][0].dtype).removeprefix("torch."),
            "model": model_info,
            "samples_sha256": samples_sha256,
            "num_samples": len(indices),
            "num_tokens": total_tokens,
            "device": backend.device(),
            "versions": package_versions(),
            "extraction_seconds": round(seconds, 3),
            "tokens_per_second": round(new_tokens / seconds, 1) if seconds > 0 and new_tokens else None,
            "resumed_samples": resumed,
            backend.name: backend.settings,
        }
        writer.finish(manifest, indices)
    finally:
        writer.close()
    return manifest


def make_backend(name: str, target: TargetSpec, aux_layer_ids: list[int], cfg: dict):
    if name not in BACKENDS:
        raise ValueError(f"unknown extraction backend {name!r} (known: {', '.join(BACKENDS)})")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(target, aux_layer_ids, cfg)


def extract(samples_path, shard: int, shard_dir: Path, target: TargetSpec, cfg: dict) -> dict:
    """The extract_hidden_states rule: one shard of a prepared dataset, with the configured backend, validated."""
    samples = read_samples(samples_path)
    config = target.load_text_config()
    aux = resolve_aux_layer_ids(cfg["aux_layer_ids"], config.num_hidden_layers)
    model_info = {**target.fingerprint(), "model_type": config.model_type, "num_hidden_layers": config.num_hidden_layers}
    log.info("extracting shard %d/%d of %s with the %s backend, aux layers %s", shard, cfg["num_shards"], samples_path,
             cfg["backend"], aux)
    backend = make_backend(cfg["backend"], target, aux, cfg)
    try:
        manifest = extract_shard(samples, sha256_file(samples_path), shard, cfg["num_shards"], Path(shard_dir), backend,
                                 model_info)
    finally:
        backend.close()
    # the files' checksums, ids and order (their contents were checked before they were written)
    validate_shard(shard_dir, samples, deep=False)
    log.info("shard %d: %d samples, %d tokens, %.0f tokens/s", shard, manifest["num_samples"], manifest["num_tokens"],
             manifest["tokens_per_second"] or 0)
    return manifest
