"""What Snakemake would rebuild in a results tree for a config, and the command that rebuilds one output, spelled so
that it works: the user's own config files, the results path as Snakemake spells it (relative to the working
directory when the tree is under it), and `--forcerun` where a plain run would plan nothing."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Rebuild:
    """How to rebuild outputs of the tree `results` (as Snakemake spells it) from the working directory `workdir` with
    `configfiles`; `planned` maps each output a plain run would rebuild to Snakemake's reason."""

    workdir: Path
    configfiles: list[str]
    results: Path
    planned: dict[str, str] = field(default_factory=dict)

    def spelled(self, path: str | Path) -> str:
        """A path relative to the working directory when under it (what Snakemake and --forcerun match), else
        absolute."""
        real, base = Path(os.path.realpath(path)), Path(os.path.realpath(self.workdir))
        return str(real.relative_to(base)) if real.is_relative_to(base) else str(real)

    def command(self, *args: str) -> str:
        here = Path(os.path.realpath(os.getcwd())) == Path(os.path.realpath(self.workdir))
        files = [shlex.quote(f if not here else self.spelled(f)) for f in self.configfiles]
        # -s where the working directory is not this checkout (Snakemake looks for ./Snakefile)
        snakefile = [] if (self.workdir / "Snakefile").is_file() else ["-s", shlex.quote(str(REPO / "Snakefile"))]
        # --configfile last: it takes every word after it (a target there would be read as a config file)
        cmd = " ".join(["snakemake", *snakefile, "--cores all", *args, *(["--configfile", *files] if files else [])])
        return cmd if here else f"cd {shlex.quote(str(self.workdir))} && {cmd}"

    def plain(self) -> str:
        return self.command()

    def forcerun(self, path: str | Path) -> str:
        """The command that rebuilds `path` and what depends on it: plain where the plan already holds it, else with
        --forcerun (a path Snakemake knows by its spelling)."""
        spelled = self.spelled(path)
        return self.plain() if spelled in self.planned else self.command("--forcerun", shlex.quote(spelled))


def snakemake_summary(workdir: Path, configfiles: list[str]) -> tuple[dict[str, str], str | None]:
    """Snakemake's own plan for the tree (`--summary`, which reads the records in workdir/.snakemake and changes
    nothing): output path -> the reason it would be rebuilt; and an error line when Snakemake could not plan."""
    cmd = [str(Path(sys.executable).parent / "snakemake"), "-s", str(REPO / "Snakefile"), "--directory", str(workdir),
           "--cores", "1", "--summary", "--nolock"]
    if configfiles:
        cmd += ["--configfile", *configfiles]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        return {}, lines[-1] if lines else f"snakemake --summary exited {proc.returncode}"
    planned = {}
    rows = [line.split("\t") for line in proc.stdout.splitlines()]
    header = next((r for r in rows if r[:1] == ["output_file"]), None)
    if header is None:
        return {}, "snakemake --summary printed no table"
    col = {name: i for i, name in enumerate(header)}
    for row in rows[rows.index(header) + 1:]:
        if len(row) == len(header) and row[col["plan"]] == "update pending":
            planned[row[col["output_file"]]] = row[col["status"]]
    return planned, None
