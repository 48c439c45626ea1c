"""What the benchmarks of perf/ share: their argument parser, where their results go, how a table is written and
which commit measured it."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

from draftsmith.io import write_json, write_text

RESULTS = Path(__file__).resolve().parent / "results"


def parser(doc: str, table: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose help is the module's docstring; with `table`, a `--table` option that defaults to
    perf/results/<table>.md."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if table:
        ap.add_argument("--table", default=str(RESULTS / f"{table}.md"),
                        help="the markdown table to write (the raw numbers go to a .json beside it)")
    return ap


def write_table(path: str | Path, table: str, raw=None) -> None:
    """Print `table`, write it to `path`, and `raw` (JSON-serialisable numbers behind it) to path's .json."""
    print(table, flush=True)
    write_text(path, table)
    if raw is not None:
        write_json(Path(path).with_suffix(".json"), raw)


def commit() -> str | None:
    """The commit measured: DRAFTSMITH_COMMIT where set (the GPU machine's copy of .git can be stale, so the caller
    names the commit it sent), else `git rev-parse`."""
    named = os.environ.get("DRAFTSMITH_COMMIT")
    if named:
        return named
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=RESULTS.parent).stdout.strip()
    return found or None
