"""How the workflow orders a one-GPU run (dry runs of the shipped SmolLM2 configs): the target-written dataset's chain
first, GPU extraction jobs leaving cores to the CPU jobs beside them, and the variants trained and benchmarked in the
order listed (the main recipe before the learning curve's smaller ones)."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml
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


def test_carried_answers_replace_self_prompts_and_regenerate(tmp_path):
    """perf/carried_overlay.py: regenerate's answers from an earlier run, as local datasets of the same names, are what
    prepare_dataset reads (the same file a regenerated dataset is prepared from); no job writes prompts or answers."""
    from conftest import load_perf_script

    config = load_config(CONFIGS)
    folder = tmp_path / "carried"
    folder.mkdir()
    for name in config["datasets"]:
        (folder / f"{name}.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, '
                                              '{"role": "assistant", "content": "hello"}]}\n')
    carried = load_perf_script("carried_overlay").carried_datasets(folder)
    overlay = tmp_path / "carried.yaml"
    overlay.write_text(yaml.safe_dump(carried))
    jobs = planned_jobs(tmp_path, cores=16, extra=[overlay])
    rules = {j["rule"] for j in jobs}
    assert not rules & {"self_prompts", "regenerate", "make_synthetic_corpus"}, rules
    assert {j["wildcards"]["dataset"] for j in jobs if j["rule"] == "prepare_dataset"} == set(config["datasets"])
    merged = load_config([*CONFIGS, overlay])["datasets"]
    assert {(d["source"], d["path"], d["regenerate"]) for d in merged.values()} == \
        {("local", str(folder / f"{name}.jsonl"), False) for name in config["datasets"]}


def test_carried_answers_unpack_from_the_parts_a_run_brings_back(tmp_path, capsys):
    """The `<results>-data.txz.part_*` files a run brings back (tar, xz, split, as perf/gpu_suite.sh packs them) are
    carried as they came and unpacked on the GPU machine: the overlay names the unpacked files, byte for byte."""
    import io
    import lzma
    import tarfile

    from conftest import load_perf_script

    regenerated = tmp_path / "run" / "results-x" / "data" / "regenerated"
    regenerated.mkdir(parents=True)
    answers = {name: "".join(f'{{"id": {i}, "text": "{name} {i}"}}\n' for i in range(300)) for name in ("a", "b")}
    for name, text in answers.items():
        (regenerated / f"{name}.jsonl").write_text(text)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(tmp_path / "run" / "results-x", arcname="results-x")
    packed = lzma.compress(buffer.getvalue())
    carried = tmp_path / "carried"
    carried.mkdir()
    size = len(packed) // 3 + 1  # three parts, as split -b cuts them
    for i in range(3):
        (carried / f"results-x-data.txz.part_{i:02d}").write_bytes(packed[i * size : (i + 1) * size])
    module = load_perf_script("carried_overlay")
    module.main([str(carried / "results-x-data.txz"), "--unpack-to", str(tmp_path / "unpacked")])
    overlay = yaml.safe_load(capsys.readouterr().out)
    assert set(overlay["datasets"]) == {"a", "b"}
    for name, text in answers.items():
        entry = overlay["datasets"][name]
        assert entry["source"] == "local" and not entry["regenerate"]
        assert Path(entry["path"]).read_text() == text
    with pytest.raises(SystemExit, match="need --unpack-to"):
        module.main([str(carried / "results-x-data.txz")])
    with pytest.raises(SystemExit, match="no missing.txz.part_"):
        module.main([str(carried / "missing.txz"), "--unpack-to", str(tmp_path / "u2")])


def suite_snakemake_calls() -> list[str]:
    """The argument text of each `python3 -m snakemake` call in perf/gpu_suite.sh (continuation lines joined, up to
    the output redirection)."""
    script = (REPO / "perf" / "gpu_suite.sh").read_text().replace("\\\n", " ")
    return [line.split("python3 -m snakemake", 1)[1].split(" > ", 1)[0]
            for line in script.splitlines() if "python3 -m snakemake" in line]


def test_gpu_suite_snakemake_calls_parse_their_targets_as_targets():
    """Twice a target placed after `--resources` (or a config file list) was read by Snakemake as one more value of
    that option, which failed only on the GPU machine, after the training. Each call of the suite, expanded by bash as
    the suite runs it, goes through Snakemake's own argument parser here: the targets are targets, the config files
    config files, and the only resource is the GPU."""
    from snakemake.cli import get_argument_parser

    calls = suite_snakemake_calls()
    assert len(calls) >= 4, calls
    env = {"PATH": "/usr/bin:/bin", "res": "results-x", "first": "default", "overlay": "/tmp/overlay.yaml",
           "EXTRA_CONFIG": "config/overlays/a.yaml config/overlays/b.yaml",
           "TARGETS": "results-x/benchmark/default/summary.json results-x/benchmark/data_20/summary.json",
           "THEN_TARGETS": "results-x/benchmark/data_03/summary.json results-x/benchmark/data_20/summary.json"}
    for call in calls:
        expanded = subprocess.run(["bash", "-c", f"printf '%s\\0' {call}"], env=env, capture_output=True, text=True,
                                  check=True).stdout.split("\0")[:-1]
        args = get_argument_parser().parse_args(expanded)
        wanted = [word for word in expanded if word.startswith("results-x/")]
        assert set(args.targets) == set(wanted), (call, args.targets)
        assert set(map(str, args.configfile)) >= set(env["EXTRA_CONFIG"].split()), call
        assert not any(str(c).startswith("results-x/") for c in args.configfile), call
        if args.resources:
            assert args.resources == {"gpu": 1}, (call, args.resources)
