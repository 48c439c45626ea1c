"""The end of `make demo`: `draftsmith summary` prints the report's one-line verdicts (and the CPU-demo caveat) from a
finished run's report.md and the next command to try on one's own model and data; the Makefile's demo target ends
with it, and its pip installs drop pip's warnings about missing index folders but keep every error."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO

from draftsmith.io import read_json
from draftsmith.report.summary import OWN_DATA_CONFIG, OWN_DATA_SECTION


def summary(results: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "draftsmith.cli", "summary", str(results)], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_summary_prints_the_reports_verdict_and_the_next_command(pipeline_run):
    results = pipeline_run / "results"
    proc = summary(results, pipeline_run)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "Verdict:"
    verdict = " ".join(line.strip() for line in lines[1:lines.index(next(x for x in lines if x.startswith("  This")))])
    draft = read_json(results / "benchmark" / "default" / "summary.json")["methods"]["eagle3_draft"]
    assert verdict.startswith("default: ") and "**" not in verdict and "`" not in verdict
    assert verdict.endswith(f"(acceptance {draft['acceptance_length']:.2f} tokens per target forward, "
                            f"{draft['speedup']:.2f}× the speed of target-only greedy).")
    md = (results / "report" / "report.md").read_text()
    assert f"- **`default`: {verdict.removeprefix('default: ').split(' (acceptance')[0]}**" in md  # the report's line
    caveat = " ".join(lines)
    assert "This is a CPU demo run (target embedded" in caveat and "a draft slower than target-only greedy is expected" in caveat
    assert f"Report: {results / 'report' / 'report.html'} (summary: {results / 'report' / 'report.md'})" in lines
    assert lines[-3:] == [f'Next, on your own model and data (README.md, "{OWN_DATA_SECTION}"):',
                          f"  cp {OWN_DATA_CONFIG} my.yaml   # set target.model and datasets",
                          "  snakemake --cores all --configfile my.yaml"]  # the interpreter is not below the cwd here
    assert f"\n## {OWN_DATA_SECTION}\n" in (REPO / "README.md").read_text() and (REPO / OWN_DATA_CONFIG).is_file()


def test_summary_of_a_run_without_a_report_names_the_file(tmp_path):
    proc = summary(tmp_path / "results", tmp_path)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr == (f"draftsmith summary: {tmp_path / 'results' / 'report' / 'report.md'}: no report; run "
                           "`snakemake --cores all` to finish the run first, or name the results directory of your "
                           "config\n")


def make(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=cwd, capture_output=True, text=True)


def test_make_demo_ends_with_the_verdict(tmp_path):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / ".draftsmith-core-installed").touch()  # installed after every lock file changed: no install planned
    proc = make("-n", "demo", f"VENV={venv}", "GPUS=0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"{venv}/bin/snakemake --cores all --resources gpu=0",
                                        f"{venv}/bin/draftsmith summary results"]


def test_make_pip_drops_missing_location_warnings_and_keeps_errors(tmp_path):
    """The Makefile's $(PIP) on the real pip with a find-links folder that does not exist (what a machine's pip config
    may name): pip's 'Location ... is ignored' warning is dropped, an error is shown and fails the target."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "draftsmith_probe-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("draftsmith_probe-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: draftsmith-probe\nVersion: 0.1\n")
        whl.writestr("draftsmith_probe-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("draftsmith_probe-0.1.dist-info/RECORD", "")
    (tmp_path / "probe.mk").write_text(
        "probe:\n\t$(PIP) download --no-index --no-deps --find-links /nonexistent-draftsmith-folder "
        f"--find-links {wheels} -d {tmp_path / 'got'} $(PKG)\n")
    bindir = Path(sys.executable).parent
    args = ["-f", str(REPO / "Makefile"), "-f", str(tmp_path / "probe.mk"), "probe", f"VENV={bindir.parent}"]
    ok = make(*args, "PKG=draftsmith-probe")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "got" / "draftsmith_probe-0.1-py3-none-any.whl").is_file()
    assert ok.stdout.startswith(f"{bindir}/python -m pip download ") and "WARNING" not in ok.stdout + ok.stderr
    missing = make(*args, "PKG=draftsmith-probe-missing")
    assert missing.returncode != 0
    assert "ERROR: Could not find a version that satisfies the requirement draftsmith-probe-missing" in missing.stderr
    assert "is ignored" not in missing.stderr
    # without the filter pip does print the warning: the test above would see it
    raw = subprocess.run([sys.executable, "-m", "pip", "download", "--no-index", "--no-deps", "--find-links",
                          "/nonexistent-draftsmith-folder", "-d", str(tmp_path / "got"), "draftsmith-probe-missing"],
                         capture_output=True, text=True)
    assert "WARNING: Location '/nonexistent-draftsmith-folder' is ignored:" in raw.stderr
