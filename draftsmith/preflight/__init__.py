"""Preflight: check the installed stack, the target and the machine in seconds, before any weights load.

Each check gives one line: `ok`, `warn` (worth knowing, not fatal) or `FAIL` (a problem that would
stop the pipeline later, typically after an expensive model load). It reads the target's
config.json only; vLLM and transformers are read as source (draftsmith.vllm_stack.probes), not imported.

    draftsmith preflight --config config/config.yaml       # or: snakemake preflight

A target the workflow builds itself (import_target, build_target) is checked once it is built: before, preflight
says so and checks the rest. It reads the hub's cache only (no download, no retries), so it takes seconds offline.
"""

from __future__ import annotations

from pathlib import Path

from draftsmith.artefacts import BUILT_TARGETS
from draftsmith.devices import visible_gpu_count
from draftsmith.io import forcerun_hint, read_json
from draftsmith.preflight.machine import (
    check_benchmark_gpus,
    check_disk,
    check_extraction_gpus,
    check_online_memory,
    check_regenerate_gpus,
    check_training_gpus,
    gpu_problems,
)
from draftsmith.vllm_stack import call_sites, compat, probes, source
from draftsmith.vllm_stack.installed import installed_version, vllm_cpu_build, vllm_torch_pin
from draftsmith.vllm_stack.target_config import read_target_config, text_part, transformers_causal_lm_types
from draftsmith.vllm_stack.verdict import Verdict

# The production stack (envs/vllm.lock.txt). vllm and its torch are checked only where a vllm backend is configured.
PINS = {
    "speculators": "==0.3.0",
    "transformers": ">=4.56,<5",
    "datasets": ">=4,<5",
    "snakemake": ">=9,<10",
    "vllm": "==0.16.0",
    "torch": "==2.9.1",
}
VLLM_ONLY = {"vllm", "torch"}
# speculators 0.3.0 fails to import on transformers 5; datasets 5 needs a huggingface_hub that transformers 4.57 rejects
HARD_PINS = {"transformers", "datasets", "speculators"}
# The stages whose jobs gate themselves with their own checks (run_preflight's `stage`): each checks only what its
# job reads, so a changed setting re-runs no job whose outputs do not depend on it.
STAGES = ("extract", "train", "benchmark")


# ----------------------------------------------------------------------------- checks


def check_versions(report: Verdict, uses_vllm: bool) -> None:
    from packaging.specifiers import SpecifierSet

    for package, pin in PINS.items():
        if package in VLLM_ONLY and not uses_vllm:
            continue
        if package == "torch":
            pin = vllm_torch_pin() or pin
        version = installed_version(package)
        name = f"version {package}"
        if version is None:
            report.add(name, "fail", f"not installed (pinned {pin})")
        elif version.split("+")[0] in SpecifierSet(pin):
            report.add(name, "ok", f"{version} (pinned {pin})")
        elif package in HARD_PINS or package == "torch":
            why = (f"the installed vLLM's compiled kernels are built against torch {pin.lstrip('=')}" if package == "torch"
                   else "the pipeline breaks outside it")
            report.add(name, "fail", f"{version} is installed; pinned {pin}: {why}")
        else:
            report.add(name, "warn", f"{version} is installed; pinned {pin} (the compatibility fixes are probed against the installed code)")


def check_fixes_and_call_sites(report: Verdict, disabled_fixes) -> None:
    with compat.disabled(*disabled_fixes):
        report.fixes = compat.fix_report()
        sites = call_sites.check_call_sites()
    failing_sites = {site.name for site, problems in sites if problems}
    for fix in compat.FIXES:
        entry = next(f for f in report.fixes if f["name"] == fix.name)
        if entry["applied"]:
            report.add(f"fix {fix.name}", "ok", f"applied ({entry['evidence']})")
        elif not entry["needed"]:
            report.add(f"fix {fix.name}", "ok", f"not needed ({entry['evidence']})")
        elif fix.call_site in failing_sites:
            continue  # the call-site line below says it
        else:
            report.add(f"fix {fix.name}", "fail", f"disabled, and the installed code needs it: {fix.problem} ({entry['evidence']})")
    for site, problems in sites:
        if problems:
            off = [f.name for f in compat.FIXES if f.call_site == site.name and f.name in disabled_fixes]
            report.add(f"call {site.name}", "fail", "; ".join(problems) + (f" (fix {off[0]} is off)" if off else ""))
    if not failing_sites:
        report.add("call sites", "ok", f"all {len(sites)} vLLM calls of the extraction backend match the installed signatures")
    missing = call_sites.check_worker_attributes()
    report.add("worker attributes", "fail" if missing else "ok",
               "; ".join(missing) if missing else "the model-runner attributes the capture reads exist in the installed vLLM")


def check_target(report: Verdict, config: dict, target: str | None, backends: set[str], offline: bool = False) -> dict | None:
    """The target's config.json, trust_remote_code, and whether the loaders in `backends` ("hf", "vllm") know it.
    `target` None: the workflow builds it and has not yet (preflight_target). `offline`: read the hub's cache only."""
    tcfg = config["target"]
    if target is None:
        report.add("target", "ok", f"built by rule {BUILT_TARGETS[tcfg['model']]}; checked after it is built")
        return None
    try:
        raw = read_target_config(target, tcfg["revision"], offline=offline)
    except Exception as e:  # noqa: BLE001 - any failure to read it is the finding
        hint = (f" (preflight reads the hub's cache only: `hf download {target} config.json` fetches the file)"
                if offline and not Path(target).is_dir() else "")
        report.add("target config", "fail", f"cannot read config.json of {target}: {type(e).__name__}: {e}{hint}")
        return None
    text = text_part(raw)
    arch = (raw.get("architectures") or ["?"])[0]
    needs_code = "auto_map" in raw
    if needs_code and not tcfg["trust_remote_code"]:
        from draftsmith.target_model.remote_code import remote_code_message

        report.add("target trust_remote_code", "fail", remote_code_message(target))
    if "vllm" in backends:
        known = set(source.registry_archs("_TEXT_GENERATION_MODELS")) | set(source.registry_archs("_MULTIMODAL_MODELS"))
        if not known:
            report.add("target architecture (vllm)", "fail", "cannot read vLLM's model registry: is vllm installed?")
        elif arch in known:
            report.add("target architecture (vllm)", "ok", f"{arch} is in vLLM's model registry")
        else:
            report.add("target architecture (vllm)", "warn",
                       f"{arch} is not in vLLM's model registry; vLLM falls back to its Transformers backend")
    if "hf" in backends:
        if text.get("model_type") in transformers_causal_lm_types() or needs_code:
            report.add("target architecture (hf)", "ok", f"model type {text.get('model_type')!r} loads with transformers")
        else:
            report.add("target architecture (hf)", "fail",
                       f"model type {text.get('model_type')!r} ({arch}) is not a causal LM transformers {installed_version('transformers')} knows")
    return text


def check_layers(report: Verdict, config: dict, text: dict, uses_vllm_states: bool) -> None:
    from draftsmith.target_model.layers import resolve_aux_layer_ids

    layers = text.get("num_hidden_layers")
    try:
        aux = resolve_aux_layer_ids(config["extraction"]["aux_layer_ids"], layers)
        report.add("layer ids", "ok", f"auxiliary layers {aux} of {layers} decoder layers")
        if 0 in aux and uses_vllm_states:
            report.add("layer ids (vllm)", "fail", "vLLM forms the state entering layer i as hidden_states + residual, "
                       "and there is no residual before layer 0: choose auxiliary layers >= 1")
    except (ValueError, TypeError) as e:
        report.add("layer ids", "fail", str(e))


def check_draft_vocab(report: Verdict, config: dict, text: dict) -> None:
    draft, target_vocab = config["vocab"]["draft_vocab_size"], text.get("vocab_size")
    if target_vocab is None:
        report.add("draft vocab", "warn", "the target config has no vocab_size")
    elif draft > target_vocab:
        report.add("draft vocab", "fail", f"vocab.draft_vocab_size={draft} exceeds the target's vocabulary of {target_vocab}")
    else:
        report.add("draft vocab", "ok", f"{draft} of the target's {target_vocab} tokens")


def check_seq_length(report: Verdict, config: dict, text: dict) -> None:
    seq_length, positions = config["seq_length"], text.get("max_position_embeddings")
    if seq_length is None or positions is None:
        report.add("seq length", "warn", "seq_length or the target's max_position_embeddings is unknown; not compared")
    elif seq_length > positions:
        report.add("seq length", "fail", f"seq_length={seq_length} exceeds the target's max_position_embeddings={positions} "
                   f"(its config.json); set seq_length to at most {positions}")
    else:
        report.add("seq length", "ok", f"seq_length={seq_length} of the target's {positions} positions")


def check_shard_count(report: Verdict, config: dict, samples: dict[str, int]) -> None:
    """extraction.num_shards against each prepared dataset's sample count: a shard without samples fails extraction."""
    num_shards = config["extraction"]["num_shards"]
    small = {d: n for d, n in samples.items() if n < num_shards}
    for dataset, n in sorted(small.items()):
        stats = Path(config["results"]) / "prepared" / dataset / "stats.json"
        fix = f"set extraction.num_shards to at most {n}" if n else "the dataset has no samples to extract"
        report.add("shard count", "fail", f"dataset {dataset!r} has {n} samples (records_kept in {stats}) but "
                   f"extraction.num_shards={num_shards}, so {num_shards - n} shard(s) would be empty; {fix}")
    if not small:
        report.add("shard count", "ok", f"extraction.num_shards={num_shards}; the smallest dataset has {min(samples.values())} samples")


def check_eagle3_serving(report: Verdict, config: dict, text: dict, gpus: int) -> None:
    """Whether the installed vLLM serves an EAGLE-3 draft for this target, and on this platform: vLLM's CPU
    platform (a CPU build, no GPU) refuses speculative decoding unless benchmark.cpu_test_worker runs the test-only
    worker (draftsmith.vllm_stack.cpu_spec_worker)."""
    supported = source.eagle3_target_model_types()
    model_type = text.get("model_type", "?")
    bench = config["benchmark"]
    version = installed_version("vllm")
    if supported is None:  # no vLLM here: what the pinned vLLM accepts
        supported, version = source.EAGLE3_TARGETS_VLLM_0_16, "0.16.0 (not installed here)"
    if not any(s in model_type for s in supported):
        message = (f"vLLM {version} accepts eagle3 only for target model types {supported} and refuses {model_type!r} "
                   "(as it refuses DeepSeek-V3-family targets such as Kimi-K2.5): the vllm benchmark needs a newer vLLM "
                   "for this target; the offline benchmark still works")
        report.add("eagle3 serving", "fail" if bench["backend"] == "vllm" else "warn", message)
        return
    served = f"vLLM {version} serves an EAGLE-3 draft for model type {model_type!r}"
    cpu_build = vllm_cpu_build() if gpus == 0 else None
    fixes = probes.cpu_spec_decode_fixes() if cpu_build else []
    refusal = next((f for f in fixes if f.name == "cpu_runner_assertion" and f.needed), None)
    if refusal is None:
        report.add("eagle3 serving", "ok", served + (f" (on its CPU platform, {cpu_build})" if cpu_build else ""))
    elif bench["cpu_test_worker"]:
        changes = ", ".join(f.name for f in fixes if f.needed)
        report.add("eagle3 serving", "ok", f"{served}, but on its CPU platform ({cpu_build}) {refusal.evidence}; "
                   f"benchmark.cpu_test_worker: the draft's server uses the TEST-ONLY worker {probes.CPU_TEST_WORKER} "
                   f"(a test harness, not for production; it changes: {changes})")
    else:
        report.add("eagle3 serving", "fail" if bench["backend"] == "vllm" else "warn",
                   f"spec decode is not available: on its CPU platform ({cpu_build}) vLLM {version} "
                   f"{refusal.evidence}, so vllm serve cannot run the draft here (benchmark.cpu_test_worker: true runs "
                   "draftsmith's test-only worker, for tests on a CPU; the offline benchmark works)")


def preflight_target(config: dict, given: str | None = None) -> str | None:
    """The target preflight checks: `given`, else the config's; None where the workflow builds it (BUILT_TARGETS)
    and has not yet: its jobs check it once built."""
    if given or config["target"]["model"] not in BUILT_TARGETS:
        return given or config["target"]["model"]
    built = Path(config["results"]) / "target"
    return str(built) if (built / "config.json").exists() else None


def run_preflight(config: dict, target_path: str | None, disabled_fixes=(), tokens: int | None = None,
                  gpus: int | None = None, samples: dict[str, int] | None = None, stage: str | None = None,
                  offline: bool = False) -> Verdict:
    """The checks for `config` (the workflow config) and the target at `target_path` (None: not built yet): all of
    them (stage None: `snakemake preflight`, `draftsmith preflight`), or those of one stage in STAGES, which that
    stage's job runs before it loads any weights. `samples` (dataset -> sample count, see count_samples) once the
    datasets are prepared; `tokens` their total, for the disk estimate. `offline`: the hub's cache only."""
    if stage is not None and stage not in STAGES:
        raise ValueError(f"preflight stage {stage!r}: use one of {STAGES}")
    extract, train, bench = (stage in (None, name) for name in STAGES)
    backends = ({config["extraction"]["backend"]} if extract else set()) | (
        {"vllm" if config["benchmark"]["backend"] == "vllm" else "hf"} if bench else set())
    report = Verdict()
    check_versions(report, "vllm" in backends)
    if extract and config["extraction"]["backend"] == "vllm" and installed_version("vllm"):
        check_fixes_and_call_sites(report, disabled_fixes)
    text = check_target(report, config, target_path, backends, offline)
    gpus = visible_gpu_count() if gpus is None else gpus
    if text is not None:
        if extract or bench:
            check_layers(report, config, text, uses_vllm_states="vllm" in backends)
        if stage is None:
            check_draft_vocab(report, config, text)
        if extract:
            check_seq_length(report, config, text)
            check_disk(report, config, text, tokens, gpus)
        if bench:
            check_eagle3_serving(report, config, text, gpus)
    if extract:
        check_extraction_gpus(report, config, gpus)
        if samples:
            check_shard_count(report, config, samples)
    if stage is None:
        check_regenerate_gpus(report, config, gpus)
    if train:
        check_training_gpus(report, config, gpus)
        if text is not None:
            check_online_memory(report, config, text, tokens, gpus)
    if bench:
        check_benchmark_gpus(report, config, gpus)
    return report


class PreflightError(RuntimeError):
    """A stage's preflight found problems; the message lists them, one per line."""


def gate(config: dict, target_path: str, stage: str, stats_paths=()) -> Verdict:
    """Run one stage's checks in its own job, before it loads any weights: log each line, raise on a problem."""
    import logging

    log = logging.getLogger(__name__)
    report = run_preflight(config, target_path, tokens=count_tokens(stats_paths) if stats_paths else None,
                           samples=count_samples(stats_paths), stage=stage)
    for line in report.lines():
        log.info("preflight (%s) %s", stage, line)
    if not report.ok:
        raise PreflightError(f"preflight ({stage}) found problems:\n" + "\n".join(report.problems))
    return report


def count_tokens(stats_paths) -> int | None:
    """Total tokens of the prepared datasets (their stats.json), or None if any is missing."""
    total = 0
    for path in stats_paths:
        if not Path(path).exists():
            return None
        total += read_json(path, rebuild=forcerun_hint(path))["tokens"]
    return total


def count_samples(stats_paths) -> dict[str, int]:
    """Samples per prepared dataset (records_kept of results/prepared/{dataset}/stats.json); missing files are left out."""
    return {Path(p).parent.name: read_json(p, rebuild=forcerun_hint(p))["records_kept"]
            for p in stats_paths if Path(p).exists()}
