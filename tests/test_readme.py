"""README's commands work as written.

Every ```bash block of README.md is read in order and each command in it is run from a directory laid out like a
checkout after a finished run (`config/` of the repository, `results/` of the session's tiny pipeline run, `my.yaml`
the config of that run, until the README's own `cp` replaces it):

- `snakemake` commands as dry runs (`-n`, the repository's Snakefile): the arguments as written must parse and the DAG
  must build;
- `draftsmith` commands for real, on the finished tiny run: they must exit 0;
- `cp` for real;
- anything in NOT_RUN (the `make` targets) is not run, for the reason given there.

A command of another kind fails the test until it is classified here. A block whose preceding line is
`<!-- readme-test: illustrative: <reason> -->` is not run. The Snakemake commands of docs/*.md and the README, code blocks
and inline code alike, are also parsed with Snakemake's own argument parser: a config file or output that the parser
would read as something else (`--configfile my.yaml results/...` reads the output as a second config file) fails.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SNAKEMAKE

README = REPO / "README.md"
MARK = re.compile(r"^<!--\s*readme-test:\s*illustrative:\s*(?P<reason>.+?)\s*-->$")
# commands not run here, each with its reason (matched on the first words)
NOT_RUN = {
    ("make", "demo"): "installs the pinned stack into .venv and runs the whole embedded DAG (about 14 minutes on a quiet "
                      "2-core machine); the pipeline tests run the same DAG at a smaller size",
    ("make", "test"): "installs the stack and a second venv with the vLLM engine (8.5 GB), then runs the whole suite, "
                      "this test included",
}


def bash_blocks(text: str) -> list[tuple[int, str | None, list[list[str]]]]:
    """(line number, illustrative reason or None, commands as argv lists) of each ```bash block."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            start = i + 1
            previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(previous)
            body = []
            i += 1
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            joined = "\n".join(body).replace("\\\n", " ")
            commands = [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]
            blocks.append((start, mark.group("reason") if mark else None, commands))
        i += 1
    return blocks


def not_run_reason(argv: list[str]) -> str | None:
    for words, reason in NOT_RUN.items():
        if tuple(argv[: len(words)]) == words:
            return reason
    return None


def run_command(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    program = argv[0]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    if program in (".venv/bin/snakemake", "snakemake"):
        cmd = [SNAKEMAKE, "-s", str(REPO / "Snakefile"), "-n", *argv[1:]]
    elif program in (".venv/bin/draftsmith", "draftsmith"):
        cmd = [sys.executable, "-m", "draftsmith.cli", *argv[1:]]  # this checkout's package, as .venv's would be
    elif program == "cp":
        cmd = argv
    else:
        raise AssertionError(f"README command {shlex.join(argv)!r}: not classified in tests/test_readme.py "
                             "(run it here, add it to NOT_RUN with the reason, or mark its block illustrative)")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def test_readme_blocks_are_found():
    blocks = bash_blocks(README.read_text())
    commands = [shlex.join(argv) for _, _, cmds in blocks for argv in cmds]
    assert len(blocks) >= 3 and any("--configfile my.yaml" in c for c in commands), commands
    for _, reason, _ in blocks:
        assert reason is None or len(reason) > 10, "an illustrative block says why"


def test_every_readme_command_runs_as_written(up_to_date_run, tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "config").symlink_to(REPO / "config")
    (checkout / "results").symlink_to(up_to_date_run / "results")
    (checkout / "my.yaml").write_text((up_to_date_run / "config.yaml").read_text())  # the config of that run
    ran, not_run = [], []
    for line, illustrative, commands in bash_blocks(README.read_text()):
        for argv in commands:
            command = shlex.join(argv)
            reason = illustrative or not_run_reason(argv)
            if reason:
                not_run.append((command, reason))
                continue
            proc = run_command(argv, checkout)
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0, f"README line {line}: `{command}` failed ({proc.returncode}):\n{output[-4000:]}"
            if argv[0].endswith("snakemake"):
                assert "This was a dry-run" in output or "Nothing to be done" in output, output[-2000:]
            ran.append(command)
    print("ran:", *ran, "not run:", *(f"{c}  ({r})" for c, r in not_run), sep="\n  ")
    assert any("snakemake" in c for c in ran) and any("draftsmith" in c for c in ran)
    assert {c for c, _ in not_run} == {"make demo", "make test"}


def snakemake_commands(text: str) -> list[tuple[int, str]]:
    """(line, command) of each Snakemake command in a Markdown file: lines of code blocks and inline code spans."""
    found = []
    in_block = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            in_block = not in_block
            continue
        spans = [line] if in_block else re.findall(r"`([^`]+)`", line)
        for span in spans:
            if m := re.search(r"(?:^|\s|/)snakemake(\s[^#|;&]*)?$", span.split(" #")[0].rstrip()):
                found.append((n, (m.group(1) or "").strip()))
    return found


DOCS = [README, *sorted((REPO / "docs").glob("*.md")), REPO / "profiles" / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_snakemake_commands_in_the_docs_mean_what_they_say(doc):
    from snakemake.cli import get_argument_parser

    parser = get_argument_parser()
    for line, rest in snakemake_commands(doc.read_text()):
        argv = shlex.split(rest)
        if {"--version", "-v", "--help", "-h"} & set(argv):
            continue
        args = parser.parse_args(argv)
        configs = [str(c) for c in args.configfile or []]
        wrong = [c for c in configs if not re.search(r"(\.ya?ml|^<[^>]+>|^\$\S+)$", c)]
        assert not wrong, (f"{doc.name}:{line}: `snakemake {rest}` reads {wrong} as config files: name outputs and rules "
                           "before --configfile (it takes several values)")
        targets = [t for t in args.targets or [] if re.search(r"\.ya?ml$", t)]
        assert not targets, f"{doc.name}:{line}: `snakemake {rest}` reads the config files {targets} as outputs"


FIRST_SCREEN = 40  # lines


def test_the_first_screen_holds_what_it_is_the_real_model_result_and_the_two_commands():
    """README's first 40 lines: what draftsmith is, the real-model result in numbers (the same ones the CPU demo's
    report points to) and the two commands, each in a block the README test above classifies."""
    from draftsmith.report.verdict import GPU_RESULT

    text = README.read_text()
    screen = "\n".join(text.splitlines()[:FIRST_SCREEN])
    assert screen.startswith("# draftsmith\n\ndraftsmith trains an [EAGLE-3]")
    assert "## What it gets on a real model" in screen
    assert "**accepts 2.03 tokens per target forward and runs at 1.54x" in screen and "On one H100" in screen
    assert "accepts 2.03 tokens per target forward and runs at 1.54× target-only greedy on one H100" in GPU_RESULT
    commands = [shlex.join(argv) for line, _, cmds in bash_blocks(text) if line <= FIRST_SCREEN for argv in cmds]
    assert commands == ["make demo", "make test"]
    # the first screen's links to later sections land on headings
    headings = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for anchor in re.findall(r"\]\(#([\w-]+)\)", screen):
        assert anchor in headings, anchor
