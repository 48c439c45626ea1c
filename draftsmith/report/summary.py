"""`draftsmith summary`: a finished run's verdict on the console, read from its report, and what to try next.

The lines are the report's own (report.md's Verdict section: one line per variant, then any note such as the CPU-demo
caveat), so the console and the report never disagree; `make demo` ends with them."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

VERDICT_HEADING = "## Verdict"
WIDTH = 110  # console columns the verdict lines wrap at
# where a new user goes next: the README section on their own model and data, and the example config it copies
OWN_DATA_SECTION = "Pointing it at a real model and dataset"
OWN_DATA_CONFIG = "config/examples/llama-3.1-8b-sharegpt.yaml"


class NoReportError(ValueError):
    """A results directory without a finished report; the message names the file."""


def plain(text: str) -> str:
    """The Markdown marks the verdict uses (**bold**, `code`) removed, for the console."""
    return re.sub(r"`([^`]+)`", r"\1", re.sub(r"\*\*(.+?)\*\*", r"\1", text))


def verdict_section(report_md: Path) -> tuple[list[str], list[str]]:
    """(one verdict line per variant, the notes under them) from a report.md, as plain text."""
    try:
        text = report_md.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise NoReportError(f"{report_md}: no report; run `snakemake --cores all` to finish the run first, or name the "
                            f"results directory of your config") from None
    lines = text.splitlines()
    if VERDICT_HEADING not in lines:
        raise NoReportError(f"{report_md}: no '{VERDICT_HEADING}' section; re-run the report with `snakemake "
                            f"--cores all --forcerun report`")
    verdicts, notes = [], []
    for line in lines[lines.index(VERDICT_HEADING) + 1:]:
        if line.startswith("#"):  # the next section, or the first variant's grounds
            break
        if line.startswith("- "):
            verdicts.append(plain(line[2:]))
        elif line.strip():
            notes.append(plain(line.strip()))
    return verdicts, notes


def _command(name: str) -> str:
    """`name` as this environment runs it: .venv/bin/<name> where the interpreter's folder is below the working
    directory, else the plain name."""
    bindir = Path(sys.executable).parent
    try:
        return f"{bindir.relative_to(Path.cwd())}/{name}"
    except ValueError:
        return name


def summary_lines(results: Path) -> list[str]:
    report = results / "report"
    verdicts, notes = verdict_section(report / "report.md")
    wrapped = [textwrap.fill(line, WIDTH, initial_indent="  ", subsequent_indent="    ") for line in verdicts + notes]
    return ["Verdict:", *wrapped,
            f"Report: {report / 'report.html'} (summary: {report / 'report.md'})",
            f'Next, on your own model and data (README.md, "{OWN_DATA_SECTION}"):',
            f"  cp {OWN_DATA_CONFIG} my.yaml   # set target.model and datasets",
            f"  {_command('snakemake')} --cores all --configfile my.yaml"]
