"""How the workflow orders a one-GPU run (dry runs of the shipped SmolLM2 configs): the target-written dataset's chain
first, GPU extraction jobs leaving cores to the CPU jobs beside them, and the variants trained and benchmarked in the
order listed (the main recipe before the learning curve's smaller ones)."""

import re
import subprocess

from conftest import REPO, SNAKEMAKE

from draftsmith.config.workflow import load_config

CONFIGS = [REPO / "config" / "gpu-smollm2.yaml", REPO / "config" / "overlays" / "smollm2-50k.yaml"]


def field(block: str, name: str, default: str) -> str:
    found = re.search(rf"^\s+{name}: (.*)$", block, re.M)
    return found.group(1) if found else default


def planned_jobs(tmp_path, cores: int, extra=()) -> list[dict]:
    """Each job of a dry run: its rule, wildcards, threads and priority (0 where Snakemake prints none)."""
    overlay = tmp_path / "results.yaml"
    overlay.write_text(f"results: {tmp_path / 'results'}\n")
    proc = subprocess.run([SNAKEMAKE, "-n", "-s", str(REPO / "Snakefile"), "--directory", str(tmp_path), "--cores",
                           str(cores), "--resources", "gpu=1", "--configfile", *map(str, CONFIGS), *map(str, extra), str(overlay)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", proc.stdout + proc.stderr):
        rule = re.match(r"(?:local)?rule (\w+):", block)
        if rule:
            wildcards = field(block, "wildcards", "")
            jobs.append({"rule": rule.group(1), "wildcards": dict(kv.split("=") for kv in wildcards.split(", ") if kv),
                         "threads": int(field(block, "threads", "1")), "priority": int(field(block, "priority", "0"))})
    return jobs


def test_the_target_written_chain_goes_first_and_gpu_extraction_leaves_cores_free(tmp_path):
    config = load_config(CONFIGS)
    written = {name for name, spec in config["datasets"].items() if spec["source"] == "self"}
    assert written == {"written"}
    jobs = planned_jobs(tmp_path, cores=16)
    chain = ("self_prompts", "regenerate", "prepare_dataset", "extract_hidden_states")
    first = {(j["rule"], j["wildcards"]["dataset"]) for j in jobs if j["priority"] > 0 and "dataset" in j["wildcards"]}
    assert first == {(rule, "written") for rule in chain}, first
    # variants in the order listed, the first (the main recipe) highest: its benchmark before the others' training
    for rule in ("train_draft", "benchmark"):
        by_priority = sorted((j for j in jobs if j["rule"] == rule), key=lambda j: -j["priority"])
        assert [j["wildcards"]["variant"] for j in by_priority] == list(config["variants"]) == \
            ["default", "data_20", "data_03"]
        assert len({j["priority"] for j in by_priority}) == 3
    assert {j["wildcards"]["dataset"] for j in jobs if j["rule"] == "regenerate" and j["priority"] == 0} \
        == set(config["datasets"]) - written
    extraction = [j for j in jobs if j["rule"] == "extract_hidden_states"]
    assert len(extraction) == len(config["datasets"])
    # on the GPU (extraction.device cuda) a job takes its writer threads and one more for the device, not all 16
    assert {j["threads"] for j in extraction} == {config["extraction"]["writer_threads"] + 2}
    assert {j["threads"] for j in jobs if j["rule"] == "train_draft"} == {16}


def gpu_snakemake_calls() -> list[str]:
    """The argument text of each Snakemake call in perf/gpu/*.sh, as bash will run it: `run_snakemake ARGS` (continuation
    lines joined, up to the output redirection) with ARGS in place of "$@" in common.sh's definition."""
    scripts = {path.name: path.read_text().replace("\\\n", " ") for path in sorted((REPO / "perf" / "gpu").glob("*.sh"))}
    definition = next(line for line in scripts.pop("common.sh").splitlines() if "python3 -m snakemake" in line)
    fixed = definition.split("python3 -m snakemake", 1)[1]
    assert '"$@"' in fixed, definition
    assert not any("python3 -m snakemake" in text for text in scripts.values()), "every call goes through run_snakemake"
    return [fixed.replace('"$@"', line.split("run_snakemake", 1)[1].split(" > ", 1)[0])
            for text in scripts.values() for line in text.splitlines() if line.lstrip().startswith("run_snakemake ")]


def test_gpu_snakemake_calls_parse_their_targets_as_targets():
    """Twice a target placed after `--resources` (or a config file list) was read by Snakemake as one more value of
    that option, which failed only on the GPU machine, after the training. Each call of perf/gpu/, expanded by bash as
    the scripts run it, goes through Snakemake's own argument parser here: the targets are targets, the config files
    config files, and the only resource is the GPU."""
    from snakemake.cli import get_argument_parser

    calls = gpu_snakemake_calls()
    assert len(calls) >= 4, calls
    rule_names = {m for smk in (REPO / "rules").glob("*.smk") for m in re.findall(r"^rule (\w+):", smk.read_text(), re.M)}
    assert {"vocab_map", "extract_hidden_states"} <= rule_names
    env = {"PATH": "/usr/bin:/bin", "res": "results-x", "first": "default", "overlay": "/tmp/overlay.yaml",
           "configs": "config/gpu-smollm2.yaml /tmp/overlay.yaml config/overlays/a.yaml config/overlays/b.yaml",
           "EXTRA_CONFIG": "config/overlays/a.yaml config/overlays/b.yaml", "UNTIL": "vocab_map",
           "TARGETS": "results-x/benchmark/default/summary.json results-x/benchmark/data_20/summary.json",
           "THEN_TARGETS": "results-x/benchmark/data_03/summary.json results-x/benchmark/data_20/summary.json",
           "THEN_CONFIG": "config/overlays/batch-1.yaml"}
    for call in calls:
        expanded = subprocess.run(["bash", "-c", f"printf '%s\\0' {call}"], env=env, capture_output=True, text=True,
                                  check=True).stdout.split("\0")[:-1]
        args = get_argument_parser().parse_args(expanded)
        wanted = [word for word in expanded if word.startswith("results-x/")]
        assert set(args.targets) == set(wanted), (call, args.targets)
        assert set(map(str, args.configfile)) >= set(env["EXTRA_CONFIG"].split()), call
        assert not any(str(c).startswith("results-x/") for c in args.configfile), call
        assert set(args.until or ()) <= rule_names, (call, args.until)  # rules, not targets read as rules
        assert args.resources == {"gpu": 1} and args.cores == 16, (call, args.resources)
