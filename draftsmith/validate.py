"""Check a whole results tree on demand against its config: every output the config implies exists and is intact
(prepared samples, shards, vocab map, drafts, benchmark results, report), and each draft and benchmark was made from
the current target, shards, vocab map and prompts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from draftsmith.io import read_json


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
    stats = read_json(path.parent / "stats.json")
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

    config = read_json(draft / "config.json")
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


def _missing(path: Path, rule: str) -> str:
    what = {"extract_hidden_states": "shard"}.get(rule, "output")
    return (f"missing: the config implies this {what} (rule {rule}); `snakemake --cores all` rebuilds it and "
            f"re-runs what depends on it (`snakemake --cores all {path}` rebuilds it alone)")


def _resolved(path: str) -> str:
    """A local path as the file it names (absolute, symlinks followed); a hub id as it is."""
    return str(Path(path).resolve()) if Path(path).exists() else path


def _by_file(inputs: dict) -> dict:
    """Recorded or current inputs with their paths (shard manifests, the target's) resolved: the results tree named
    another way (relative or absolute, through a symlink) holds the same inputs."""
    out = dict(inputs)
    if isinstance(out.get("shards"), dict):
        out["shards"] = {_resolved(k): v for k, v in out["shards"].items()}
    if isinstance(out.get("target"), dict) and isinstance(out["target"].get("path"), str):
        out["target"] = {**out["target"], "path": _resolved(out["target"]["path"])}
    return out


def _check_inputs(recorded: dict | None, current: dict, made_from: str) -> None:
    """A draft's or a benchmark's recorded inputs against the results tree and target as they are now."""
    from draftsmith.provenance import changed_keys

    if recorded is None:
        raise ValueError(f"no record of the {made_from} it was made from (an older draftsmith wrote it); "
                         "`snakemake --cores all --forcerun <this rule>` rebuilds it")
    recorded, current = _by_file(recorded), _by_file(json.loads(json.dumps(current, default=str)))
    if recorded != current:
        raise ValueError(f"made from other {made_from} than the current ones (changed: "
                         f"{', '.join(changed_keys(recorded, current))}); `snakemake --cores all` rebuilds it")


def validate_results(config: dict, results: str | Path | None = None) -> list[Finding]:
    """Hold the results tree to `config` (a validated workflow config; `results` overrides its `results`):
    every output the config implies exists and is intact, and each draft and benchmark was made from the
    current target, shards, vocab map and prompts."""
    from draftsmith import artefacts
    from draftsmith.extraction.shards import validate_shard
    from draftsmith.provenance import benchmark_inputs, draft_inputs, model_fingerprint, same_model

    if results is not None:
        config = {**config, "results": str(results)}
    results = Path(config["results"])
    expected = artefacts.expected_outputs(config)
    findings: list[Finding] = []
    for rule, paths in expected.items():
        for path in paths:
            if rule == "extract_hidden_states" and (path.parent / "progress.jsonl").exists():
                findings.append(Finding(str(path.parent), False, "unfinished shard (progress.jsonl without manifest); "
                                        "`snakemake --cores all` resumes it"))
            elif not path.exists():
                findings.append(Finding(str(path.parent if rule == "extract_hidden_states" else path), False,
                                        _missing(path, rule)))
    exists = {rule: [p for p in paths if p.exists()] for rule, paths in expected.items()}
    present, total = sum(map(len, exists.values())), sum(map(len, expected.values()))
    if present == total:
        findings.append(Finding(str(results), True, f"all {total} outputs the config implies exist"))
    target = artefacts.target_model(config)
    fingerprint = {**model_fingerprint(target), "revision": config["target"]["revision"]}

    samples_by_dataset = {}
    for path in exists["prepare_dataset"]:
        if path.name == "samples.parquet":
            samples_by_dataset[path.parent.name] = _check(findings, path, lambda p=path: _check_samples(p))

    def check_shard(manifest: Path):
        validate_shard(manifest.parent, samples_by_dataset.get(manifest.parent.parent.name), deep=True)
        if not same_model(read_json(manifest)["model"], fingerprint):
            raise ValueError(f"extracted from another target than the current {target}; `snakemake --cores all` "
                             "re-extracts it")

    for manifest in exists["extract_hidden_states"]:
        _check(findings, manifest.parent, lambda m=manifest: check_shard(m))
    vocab = None
    if all(p.exists() for p in expected["vocab_map"]):
        vocab = _check(findings, results / "vocab", lambda: _check_vocab(results / "vocab"))
    d2t, t2d = results / "vocab" / "d2t.npy", results / "vocab" / "t2d.npy"
    for variant in sorted(config["variants"]):
        draft = results / "draft" / variant
        if not all((draft / name).exists() for name in artefacts.DRAFT_FILES):
            continue

        def check_draft(d=draft, v=variant):
            _check_draft(d, vocab)
            manifests = [m for m in artefacts.variant_manifests(config, v) if m.exists()]
            current = draft_inputs(manifests, d2t, t2d, fingerprint) if d2t.exists() and t2d.exists() else {}
            _check_inputs(read_json(d / "training_data.json").get("inputs"), current, "target, shards or vocab map")

        _check(findings, draft, check_draft)
        prompts = results / "benchmark" / "prompts.jsonl"
        for summary in (results / "benchmark" / variant / "summary.json",
                        results / "benchmark" / variant / "offline" / "summary.json"):
            if summary.exists() and prompts.exists():
                _check(findings, summary, lambda s=summary, d=draft: _check_inputs(
                    read_json(s).get("inputs"), benchmark_inputs(d, prompts, fingerprint), "draft, prompts or target"))
    return findings


def write_findings(findings: list[Finding], path: str | Path) -> None:
    from draftsmith.io import write_json

    write_json(path, {"ok": all(f.ok for f in findings), "findings": [asdict(f) for f in findings]})
