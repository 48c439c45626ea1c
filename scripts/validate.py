import logging

from draftsmith.smk import run, to_console
from draftsmith.validate import validate_results


def main(smk):
    log = logging.getLogger("draftsmith.validate")
    findings = validate_results(smk.config, configfiles=list(smk.params.configfiles))
    lines = [f"{'ok  ' if f.ok else 'FAIL'} {f.path}: {f.message}" for f in findings]
    for f, line in zip(findings, lines):
        (log.info if f.ok else log.error)(line)
    bad = sum(not f.ok for f in findings)
    to_console([*lines, f"validate: {len(findings) - bad} passed, {bad} failed (log: {smk.log[0]})"])
    if bad:
        raise SystemExit(f"validate: {bad} of {len(findings)} checks failed")


run(main, snakemake)  # noqa: F821
