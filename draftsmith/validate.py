"""Check a whole results tree on demand: prepared samples, shards, vocab map, drafts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class Finding:
    path: str
    ok: bool
    message: str


def _check(findings: list[Finding], path: Path, fn) -> object:
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - every failure is a finding with its message
        findings.append(Finding(str(path), False, f"{type(e).__name__}: {e}"))
        return None
    findings.append(Finding(str(path), True, "ok"))
    return result


def _check_samples(path: Path):
    from draftsmith.data.tokenization import read_samples

    samples = read_samples(path)
    stats = json.loads((path.parent / "stats.json").read_text())
    if stats["records_kept"] != len(samples["sample_id"]):
        raise ValueError(f"stats.json says {stats['records_kept']} records kept, samples.parquet has {len(samples['sample_id'])}")
    empty = [sid for sid, mask in zip(samples["sample_id"], samples["loss_mask"]) if not any(mask)]
    if empty:
        raise ValueError(f"samples without assistant tokens: {empty[:3]}")
    return samples


def _check_vocab(vocab: Path):
    from draftsmith.vocab import load_vocab_map

    d2t, t2d = (m.numpy() for m in load_vocab_map(vocab / "d2t.npy", vocab / "t2d.npy"))
    if int(t2d.sum()) != len(d2t) or not np.array_equal(np.flatnonzero(t2d), np.arange(len(d2t)) + d2t):
        raise ValueError("d2t and t2d do not describe the same draft vocabulary")
    return d2t, t2d


def _check_draft(draft: Path, vocab: tuple | None):
    from safetensors import safe_open

    config = json.loads((draft / "config.json").read_text())
    if config.get("speculators_model_type") != "eagle3" or not config.get("eagle_aux_hidden_state_layer_ids"):
        raise ValueError("config.json is not an EAGLE-3 speculators config with eagle_aux_hidden_state_layer_ids")
    import torch

    with safe_open(draft / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        missing = {"fc.weight", "lm_head.weight", "d2t", "t2d"} - names
        if missing:
            raise ValueError(f"model.safetensors lacks {sorted(missing)}")
        if vocab is not None and not np.array_equal(f.get_tensor("d2t").numpy(), vocab[0]):
            raise ValueError("the draft's d2t differs from results/vocab/d2t.npy (stale draft?)")
        for name in names:
            tensor = f.get_tensor(name)
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ValueError(f"{name} contains NaN or Inf")


def expected_shards(config: dict) -> dict[str, int]:
    """The shards a workflow config implies: dataset -> extraction.num_shards."""
    return {dataset: config["extraction"]["num_shards"] for dataset in sorted(config["datasets"])}


def _check_expected_shards(findings: list[Finding], results: Path, shards: dict[str, int]) -> None:
    for dataset, num_shards in shards.items():
        for k in range(num_shards):
            shard = results / "shards" / dataset / f"shard_{k}"
            if not (shard / "manifest.json").exists() and not (shard / "progress.jsonl").exists():
                findings.append(Finding(str(shard), False, (
                    f"missing: the config has dataset {dataset!r} with extraction.num_shards={num_shards}; "
                    f"`snakemake --cores all` re-extracts it and re-runs what depends on it "
                    f"(`snakemake --cores all {shard / 'manifest.json'}` re-extracts it alone)")))


def validate_results(results: str | Path, shards: dict[str, int] | None = None) -> list[Finding]:
    """Check everything under `results`; `shards` (dataset -> shard count, see expected_shards) also
    requires each of those shards to exist."""
    from draftsmith.extraction.shards import validate_shard

    results = Path(results)
    findings: list[Finding] = []
    _check_expected_shards(findings, results, shards or {})
    samples_by_dataset = {}
    for path in sorted(results.glob("prepared/*/samples.parquet")):
        samples_by_dataset[path.parent.name] = _check(findings, path, lambda p=path: _check_samples(p))
    for manifest in sorted(results.glob("shards/*/shard_*/manifest.json")):
        samples = samples_by_dataset.get(manifest.parent.parent.name)
        _check(findings, manifest.parent, lambda d=manifest.parent, s=samples: validate_shard(d, s, deep=True))
    for journal in sorted(results.glob("shards/*/shard_*/progress.jsonl")):
        findings.append(Finding(str(journal.parent), False, "unfinished shard (progress.jsonl without manifest); re-run to resume it"))
    vocab = None
    if (results / "vocab" / "d2t.npy").exists():
        vocab = _check(findings, results / "vocab", lambda: _check_vocab(results / "vocab"))
    for draft in sorted(p.parent for p in results.glob("draft/*/config.json")):
        _check(findings, draft, lambda d=draft: _check_draft(d, vocab))
    if not findings:
        findings.append(Finding(str(results), False, "nothing to validate: no prepared samples, shards, vocab map or drafts"))
    return findings


def write_findings(findings: list[Finding], path: str | Path) -> None:
    from draftsmith.io import write_json

    write_json(path, {"ok": all(f.ok for f in findings), "findings": [asdict(f) for f in findings]})
