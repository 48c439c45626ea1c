"""Where each rule's log and Snakemake benchmark file go: under the results directory of the config that ran it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from conftest import REPO, snakemake, write_config

# configs that together plan every rule of the workflow: the tiny one (build_target), and one with the packaged
# target, a regenerated dataset, prompts the target writes and the vLLM benchmark with its offline reference
# (import_target, regenerate, self_prompts, benchmark_offline_reference)
CONFIGS = {
    "tiny": {},
    "packaged": {"target": {"model": "smollm2-135m-instruct"},
                 "datasets": {"synthetic": {"source": "synthetic", "regenerate": True},
                              "written": {"source": "self", "num_prompts": 4, "regenerate": True}},
                 "benchmark": {"backend": "vllm", "offline_reference": True}},
}


def planned_files(proc: subprocess.CompletedProcess) -> dict[str, list[tuple[str, str]]]:
    """Rule -> [(log|benchmark, path)] from a dry run's job listing."""
    files: dict[str, list[tuple[str, str]]] = {}
    rule = None
    for line in proc.stdout.splitlines():
        if m := re.match(r"^(?:local)?rule (\w+):$", line):
            rule = m.group(1)
            files.setdefault(rule, [])
        elif rule and (m := re.match(r"^\s+(log|benchmark): (.+)$", line)):
            files[rule].append((m.group(1), m.group(2)))
    return files


def all_rules() -> set[str]:
    """Every rule that makes something (absolute_path_into_results only explains a misspelt target, and fails)."""
    rules = set()
    for smk in (REPO / "rules").glob("*.smk"):
        rules |= set(re.findall(r"^\s*rule (\w+):", smk.read_text(), re.M))
    return rules - {"absolute_path_into_results"}


def test_every_rule_logs_under_the_results_of_its_config(tmp_path):
    """Two configurations run from one directory keep their logs and benchmark files apart: each lies under
    its own `results:` (they were in ./logs and ./benchmarks, shared by every configuration)."""
    seen: set[str] = set()
    for name, overrides in CONFIGS.items():
        write_config(tmp_path, overrides)
        results = tmp_path / "results"
        config = tmp_path / "config.yaml"
        config.write_text(config.read_text().replace(str(results), str(tmp_path / f"results-{name}")))
        proc = snakemake(tmp_path, "-n", "--forceall", "all", "preflight", "validate")
        planned = planned_files(proc)
        for rule, files in planned.items():
            if rule == "all":
                continue
            kinds = {kind for kind, _ in files}
            assert "log" in kinds, f"{name}: rule {rule} has no log"
            if rule not in ("preflight", "validate"):  # no output: a benchmark file would make them look done
                assert "benchmark" in kinds, f"{name}: rule {rule} has no benchmark file"
            for kind, path in files:
                # relative to the working directory, as Snakemake spells a tree under it
                assert (tmp_path / path).is_relative_to(tmp_path / f"results-{name}" / f"{kind}s"), (name, rule, path)
        seen |= set(planned)
    assert all_rules() <= seen, f"rules no config planned: {sorted(all_rules() - seen)}"
    assert not (tmp_path / "logs").exists() and not (tmp_path / "benchmarks").exists()


def test_logs_under_results_are_ignored_by_git():
    for path in ("results/logs/prepare_dataset/x.log", "results/benchmarks/report.tsv",
                 "results-gpu/logs/report.log"):
        proc = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "--no-index", path])
        assert proc.returncode == 0, f"{path} is not ignored"
