import logging
from pathlib import Path

from draftsmith.smk import run, to_console
from draftsmith.preflight import count_samples, count_tokens, preflight_target, run_preflight


def main(smk):
    stats = [Path(smk.config["results"]) / "prepared" / d / "stats.json" for d in smk.config["datasets"]]
    report = run_preflight(smk.config, preflight_target(smk.config), tokens=count_tokens(stats),
                           samples=count_samples(stats), offline=True)
    log = logging.getLogger("draftsmith.preflight")
    for line in report.lines():
        log.info(line)
    verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    to_console([*report.lines(), f"preflight: {verdict} (log: {smk.log[0]})"])
    if not report.ok:
        raise SystemExit("preflight found problems:\n" + "\n".join(report.problems))


run(main, snakemake)  # noqa: F821
