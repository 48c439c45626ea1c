"""Check a whole results tree on demand against its config: every output the config implies exists and is intact
(prepared samples, shards, vocab map, drafts, benchmark results, report), and each draft and benchmark was made from
the current target, shards, vocab map and prompts."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from draftsmith.io import read_json
from draftsmith.rebuild import Rebuild, snakemake_summary


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


def _missing(path: Path, rule: str, rebuild: Rebuild) -> str:
    what = {"extract_hidden_states": "shard"}.get(rule, "output")
    return (f"missing: the config implies this {what} (rule {rule}); `{rebuild.plain()}` rebuilds it and "
            f"re-runs what depends on it (`{rebuild.command(rebuild.spelled(path))}` rebuilds it alone)")


def _resolved(path: str, base: Path) -> str:
    """A local path (relative to `base`) as the file it names (absolute, symlinks followed); a hub id as it is."""
    return str((base / path).resolve()) if (base / path).exists() else path


def _by_file(inputs: dict, base: Path) -> dict:
    """Recorded or current inputs with their paths (shard manifests, the target's) resolved against `base` (a job's
    working directory, or here): the results tree named another way (relative or absolute, through a symlink, from
    another directory) holds the same inputs."""
    out = dict(inputs)
    if isinstance(out.get("shards"), dict):
        out["shards"] = {_resolved(k, base): v for k, v in out["shards"].items()}
    if isinstance(out.get("target"), dict) and isinstance(out["target"].get("path"), str):
        out["target"] = {**out["target"], "path": _resolved(out["target"]["path"], base)}
    return out


def _check_inputs(recorded: dict | None, current: dict, made_from: str, fix: str, workdir: Path) -> None:
    """A draft's or a benchmark's recorded inputs against the results tree and target as they are now."""
    from draftsmith.provenance import changed_keys

    if recorded is None:
        raise ValueError(f"no record of the {made_from} it was made from (an older draftsmith wrote it); "
                         f"`{fix}` rebuilds it")
    recorded = _by_file(recorded, workdir)  # the paths its job saw, from Snakemake's working directory
    current = _by_file(json.loads(json.dumps(current, default=str)), Path.cwd())
    if recorded != current:
        raise ValueError(f"made from other {made_from} than the current ones (changed: "
                         f"{', '.join(changed_keys(recorded, current))}); `{fix}` rebuilds it")


def _digest_changes(recorded, current) -> str:
    """What differs between an output's recorded digest and its current one (a directory file by file)."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        gone = sorted(set(recorded) - set(current))
        changed = sorted(k for k in set(recorded) & set(current) if recorded[k] != current[k])
        added = sorted(set(current) - set(recorded))
        parts = [f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("deleted", gone), ("changed", changed), ("added", added)) if names]
        return "; ".join(parts)
    return f"sha256 {str(recorded)[:12]}... when made, {str(current)[:12]}... now"


def _check_records(findings: list[Finding], results: Path, expected: dict, rebuild: Rebuild) -> None:
    """The chain of checksums: each output as its job wrote it, and each job's inputs as it read them
    (draftsmith.provenance.record_job)."""
    from draftsmith.fingerprints import ContentHashes
    from draftsmith.provenance import job_records, tree_key

    hashes = ContentHashes(results)
    records = job_records(results)
    made = {out: rec for rec in records for out in rec["outputs"]}
    wanted = {tree_key(p, results) for paths in expected.values() for p in paths}

    def now(key: str, whole: bool = False):
        """An output's digest as record_job wrote it (a directory file by file); an input's as one digest."""
        path = Path(key) if Path(key).is_absolute() else results / key
        return hashes.directory(path) if path.is_dir() and not whole else hashes.fingerprint(path)

    changed, before, unrecorded = set(), len(findings), []
    for rule, paths in expected.items():
        for path in (p for p in paths if p.exists()):
            key, rec = tree_key(path, results), made.get(tree_key(path, results))
            if rec is None:
                unrecorded.append(path)
            elif now(key) != rec["outputs"][key]:
                changed.add(key)
                findings.append(Finding(str(path), False, f"changed since rule {rec['rule']} made it "
                                        f"({_digest_changes(rec['outputs'][key], now(key))}); "
                                        f"`{rebuild.forcerun(path)}` rebuilds it and what depends on it"))
    for rec in records:
        outputs = [k for k in rec["outputs"] if k in wanted]
        stale = [k for k, digest in rec["inputs"].items() if k not in changed and now(k, whole=True) != digest]
        if outputs and stale:
            first = results / outputs[0]
            findings.append(Finding(str(first), False, f"made by rule {rec['rule']} from other inputs than the "
                                    f"current ones (changed since: {', '.join(stale[:3])}); "
                                    f"`{rebuild.forcerun(first)}` rebuilds it"))
    if unrecorded:  # one finding: a tree made by an older draftsmith has none at all
        first = unrecorded[0]
        findings.append(Finding(str(first), False, f"no record of the job that made it, nor of {len(unrecorded) - 1} "
                                "other outputs (made by an older draftsmith, or put there by hand), so their checksums "
                                f"cannot be followed; `{rebuild.forcerun(first)}` rebuilds it and what depends on it"))
    if len(findings) == before and records:
        findings.append(Finding(str(results), True, f"every output is as its job wrote it, from the inputs it read "
                                f"({len(records)} job records)"))
    hashes.save()


def _check_plan(findings: list[Finding], results: Path, expected: dict, rebuild: Rebuild, error: str | None) -> None:
    """Outputs Snakemake would rebuild for this config (a setting, an input's content or the code changed): one
    finding per job, named by its first output."""
    from draftsmith.provenance import job_records, tree_key

    if error:
        findings.append(Finding(str(rebuild.results), False, f"Snakemake could not plan this tree: {error}"))
        return
    first_output = {out: next(iter(rec["outputs"])) for rec in job_records(results) for out in rec["outputs"]}
    jobs: dict[str, list] = {}
    for rule, paths in expected.items():
        for path in (p for p in paths if p.exists()):
            reason = rebuild.planned.get(rebuild.spelled(path))
            if reason:
                key = tree_key(path, results)
                jobs.setdefault(first_output.get(key, key), []).append((rule, path, reason))
    for (rule, path, reason), *others in jobs.values():
        why = "an input is rebuilt first" if reason == "ok" else reason
        more = f" (and {len(others)} more outputs of its job)" if others else ""
        findings.append(Finding(str(path), False, f"stale for this config{more}: Snakemake would rebuild it (rule "
                                f"{rule}: {why}); `{rebuild.plain()}` rebuilds it"))


def validate_results(config: dict, results: str | Path | None = None, configfiles: list[str] | None = None,
                     workdir: str | Path | None = None) -> list[Finding]:
    """Hold the results tree to `config` (a validated workflow config, read from `configfiles`; `results` overrides
    its `results`): every output the config implies exists, is intact and is as its job wrote it, each job's inputs
    are those it read, Snakemake (run from `workdir`, default here) would rebuild nothing for the config, and each
    draft and benchmark was made from the current target, shards, vocab map and prompts. Each failure names the
    command that rebuilds it."""
    from draftsmith import artefacts
    from draftsmith.extraction.shards import validate_shard
    from draftsmith.provenance import benchmark_inputs, draft_inputs, model_fingerprint, same_model

    if results is not None:
        config = {**config, "results": str(results)}
    results = Path(config["results"])
    expected = artefacts.expected_outputs(config)
    findings: list[Finding] = []
    workdir = Path(workdir or os.getcwd())
    planned, plan_error = snakemake_summary(workdir, list(configfiles or []))
    rebuild = Rebuild(workdir, list(configfiles or []), results, planned)
    for rule, paths in expected.items():
        for path in paths:
            if rule == "extract_hidden_states" and (path.parent / "progress.jsonl").exists():
                findings.append(Finding(str(path.parent), False, "unfinished shard (progress.jsonl without manifest); "
                                        f"`{rebuild.plain()}` resumes it"))
            elif not path.exists():
                findings.append(Finding(str(path.parent if rule == "extract_hidden_states" else path), False,
                                        _missing(path, rule, rebuild)))
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
            raise ValueError(f"extracted from another target than the current {target}; `{rebuild.forcerun(manifest)}` "
                             "re-extracts it")

    for manifest in exists.get("extract_hidden_states", []):
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
            states = [m for m in artefacts.variant_states_inputs(config, v) if m.exists()]
            current = draft_inputs(states, d2t, t2d, fingerprint) if d2t.exists() and t2d.exists() else {}
            what = "target, prepared samples or vocab map" if artefacts.online_states(config) else "target, shards or vocab map"
            _check_inputs(read_json(d / "training_data.json").get("inputs"), current, what,
                          rebuild.forcerun(d / "model.safetensors"), workdir)

        _check(findings, draft, check_draft)
        prompts = results / "benchmark" / "prompts.jsonl"
        for summary in (results / "benchmark" / variant / "summary.json",
                        results / "benchmark" / variant / "offline" / "summary.json"):
            if summary.exists() and prompts.exists():
                _check(findings, summary, lambda s=summary, d=draft: _check_inputs(
                    read_json(s).get("inputs"), benchmark_inputs(d, prompts, fingerprint), "draft, prompts or target",
                    rebuild.forcerun(s), workdir))
    _check_records(findings, results, expected, rebuild)
    _check_plan(findings, results, expected, rebuild, plan_error)
    return findings


def write_findings(findings: list[Finding], path: str | Path) -> None:
    from draftsmith.io import write_json

    write_json(path, {"ok": all(f.ok for f in findings), "findings": [asdict(f) for f in findings]})
