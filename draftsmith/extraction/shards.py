"""The shard format and its validation: speculators data-format-v1 files plus a manifest.

A shard directory holds `data_{i}.pt` files (`input_ids`, `hidden_states` = list of four
`[seq, hidden]` tensors, `loss_mask`), `i` being the sample's index in the prepared
dataset, and `manifest.json`, written last (draftsmith.extraction.driver writes them).
"""

from __future__ import annotations

import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from draftsmith.io import read_json, sha256_file

MANIFEST = "manifest.json"
JOURNAL = "progress.jsonl"
FORMAT = "speculators-data-v1"
NUM_STATES = 4


class ShardError(ValueError):
    """A shard that must not be used; the message names the shard, the file and the check."""


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


# ----------------------------------------------------------------------------- validation


def manifest_rebuild_hint(path: str | Path) -> str:
    """What brings back the shard of a manifest that does not parse (Snakemake takes any existing manifest
    as a finished shard, so a plain re-run would fail the same way)."""
    path = Path(path)
    return (f"the shard is unusable and Snakemake takes it as finished while this file exists: rebuild it with "
            f"`snakemake --forcerun {path}`, or delete {path.parent} and run `snakemake` (which re-extracts a "
            "missing shard)")


def read_manifest(path: str | Path) -> dict:
    """A shard's manifest.json; one that does not parse raises an InvalidJSONFileError (a ValueError) naming
    it and the command that rebuilds the shard."""
    return read_json(path, rebuild=manifest_rebuild_hint(path))


def manifests_read_not_made(jobs, shards_root: str | Path) -> list[str]:
    """The shard manifests (`shards_root/<dataset>/shard_<k>/manifest.json`) that some of `jobs` (Snakemake
    jobs: .input, .output) read and none of them makes."""
    root = os.path.abspath(shards_root)
    made = {os.path.abspath(f) for job in jobs for f in job.output}
    read = {os.path.abspath(f) for job in jobs for f in job.input} - made
    found = sorted(f for f in read if os.path.basename(f) == MANIFEST and os.path.dirname(os.path.dirname(os.path.dirname(f))) == root)
    # spelled as `shards_root` is (relative for a tree under the working directory): the hint's --forcerun must match
    return found if os.path.isabs(shards_root) else [os.path.relpath(f) for f in found]


def unreadable_manifests(paths) -> list[str]:
    """For each existing manifest among `paths` that does not parse, the message naming it and its rebuild."""
    problems = []
    for path in paths:
        try:
            read_manifest(path)
        except json.JSONDecodeError as e:
            problems.append(str(e))
        except FileNotFoundError:
            pass
    return problems


def load_manifest(shard_dir: str | Path) -> dict:
    path = Path(shard_dir) / MANIFEST
    if not path.exists():
        raise ShardError(f"{shard_dir}: no {MANIFEST}; the shard is unfinished or was not extracted")
    try:
        return read_manifest(path)
    except json.JSONDecodeError as e:
        raise ShardError(str(e)) from None


def validate_shard(shard_dir: str | Path, samples: dict[str, list] | None = None, deep: bool = True,
                   workers: int | None = None) -> dict:
    """Check a shard against its manifest; raise ShardError naming shard, file and check.

    Checks: every file exists with the recorded sha256; with `deep`, each file loads with
    the four states of shape [num_tokens, hidden] and the recorded dtype, finite, no
    all-zero layer, input_ids/loss_mask of the right length; with `samples` (the prepared
    dataset), the sample ids, their order and the token ids echo the input. Files are checked
    by `workers` threads (default: one per core; hashing and loading release the GIL), and
    the first failing file in the manifest's order is the one reported.
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

    def check(entry):
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

    pool = ThreadPoolExecutor(max_workers=workers or min(32, os.cpu_count() or 1))
    try:
        for future in [pool.submit(check, entry) for entry in entries]:
            future.result()  # in manifest order: the first failing file is the one named
    finally:
        pool.shutdown(cancel_futures=True)
    return manifest


def check_sample(path: Path, where: str, num_tokens: int, hidden_size: int, dtype: torch.dtype, input_ids: list[int] | None):
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any load failure means a corrupt file
        raise ShardError(f"{where}: load: {type(e).__name__}: {e}") from e
    for key in ("input_ids", "hidden_states", "loss_mask"):
        if key not in data:
            raise ShardError(f"{where}: format: missing key {key!r}")
    if data["input_ids"].shape != (num_tokens,) or data["loss_mask"].shape != (num_tokens,):
        raise ShardError(f"{where}: shape: input_ids/loss_mask length differs from num_tokens={num_tokens}")
    if input_ids is not None and data["input_ids"].tolist() != list(input_ids):
        raise ShardError(f"{where}: token ids: stored input_ids differ from the prepared sample")
    check_states(data["hidden_states"], where, num_tokens, hidden_size, dtype)


def check_states(states: list[torch.Tensor], where: str, num_tokens: int, hidden_size: int | None = None,
                 dtype: torch.dtype | None = None):
    """A sample's hidden states: four of shape [num_tokens, hidden_size] (when given; else one width for all four),
    of `dtype` (when given), finite, and no layer all zeros. Extraction runs it on the states in memory before
    writing them; `check_sample` on a file read back."""
    if len(states) != NUM_STATES:
        raise ShardError(f"{where}: format: {len(states)} hidden-state tensors, expected {NUM_STATES}")
    hidden_size = hidden_size if hidden_size is not None else states[0].shape[-1]
    for layer, state in enumerate(states):
        if tuple(state.shape) != (num_tokens, hidden_size):
            raise ShardError(f"{where}: shape: hidden_states[{layer}] is {tuple(state.shape)}, expected ({num_tokens}, {hidden_size})")
        if dtype is not None and state.dtype != dtype:
            raise ShardError(f"{where}: dtype: hidden_states[{layer}] is {state.dtype}, manifest says {dtype}")
        largest = state.abs().amax()  # one pass for both checks: amax propagates NaN, and Inf is its own maximum
        if not torch.isfinite(largest):
            raise ShardError(f"{where}: finite: hidden_states[{layer}] contains NaN or Inf")
        if not largest > 0:
            raise ShardError(f"{where}: non-zero: hidden_states[{layer}] is all zeros")


def shard_files(manifest_paths: list[str | Path]) -> list[str]:
    """The sample files listed by the given manifests, in manifest order."""
    files = []
    for mp in manifest_paths:
        mp = Path(mp)
        manifest = read_manifest(mp)
        files += [str(mp.parent / e["file"]) for e in manifest["samples"]]
    return files
