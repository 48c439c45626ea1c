"""perf/ as a bench suite: `python -m perf` lists every benchmark, tool and GPU script; every module of perf/ is
registered and runs through `python -m perf <name>`; perf/results/README.md indexes every raw file there."""

import re
import subprocess
import sys

import pytest
from conftest import REPO

import perf


def run_perf(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perf", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_listing_names_every_benchmark_tool_and_gpu_script_and_every_module_is_registered():
    listed = run_perf()
    assert listed.returncode == 0, listed.stderr
    names = {line.split()[0] for line in listed.stdout.splitlines() if line.startswith("  ")}
    scripts = {path.name for path in (REPO / "perf" / "gpu").glob("*.sh")}
    assert names == set(perf.BENCHMARKS) | set(perf.TOOLS) | scripts
    assert {"setup.sh", "pipeline.sh", "smollm2.sh", "bench.sh", "launch.sh", "poll.sh"} <= scripts
    modules = {path.stem for path in (REPO / "perf").glob("*.py")} - {"__init__", "__main__", "common"}
    assert modules == set(perf.BENCHMARKS) | set(perf.TOOLS), "a perf/ module that `python -m perf` does not list"
    for path in (REPO / "perf").glob("*.py"):
        assert "sys.path" not in path.read_text(), path


def test_a_registered_tool_runs_by_name_and_an_unknown_name_fails_in_one_line(tmp_path):
    helped = run_perf("round_costs", "-h")
    assert helped.returncode == 0 and "per_prompt" in helped.stdout, helped.stderr
    unknown = run_perf("no_such_bench")
    assert unknown.returncode == 1
    assert unknown.stderr.strip() == "perf: no benchmark or tool named 'no_such_bench'; `python -m perf` lists them"


def expand(name: str) -> list[str]:
    """`a{b,c}d{e,f}` -> abde, abdf, acde, acdf (the index's shorthand for files of one run)."""
    braces = re.search(r"\{([^{}]+)\}", name)
    if not braces:
        return [name.rstrip("/")]
    return [full for part in braces.group(1).split(",")
            for full in expand(name[: braces.start()] + part + name[braces.end():])]


def test_results_index_lists_every_file_and_folder_and_nothing_else():
    results = REPO / "perf" / "results"
    index = (results / "README.md").read_text()
    cited = {full for cell in re.findall(r"^\| (.+?) \| ", index, re.M)[2:]
             for name in re.findall(r"`([^`]+)`", cell) for full in expand(name)}
    present = {path.name for path in results.iterdir()} - {"README.md"}
    assert present - cited == set(), "files in perf/results/ that its README.md does not list"
    assert cited - present == set(), "perf/results/README.md lists files that are not there"


@pytest.mark.parametrize("name", sorted(perf.BENCHMARKS) + sorted(perf.TOOLS))
def test_every_registered_module_imports_and_has_an_entry_point(name):
    module = __import__(f"perf.{name}", fromlist=["main"])
    assert callable(module.main) and module.__doc__
