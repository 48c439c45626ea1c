import logging

from draftsmith.smk import run
from draftsmith.validate import validate_results


def main(smk):
    log = logging.getLogger("draftsmith.validate")
    findings = validate_results(smk.params.results, smk.params.shards)
    for f in findings:
        (log.info if f.ok else log.error)("%s %s: %s", "ok" if f.ok else "FAIL", f.path, f.message)
    bad = [f for f in findings if not f.ok]
    if bad:
        raise SystemExit(f"{len(bad)} of {len(findings)} checks failed; see the log: " + "; ".join(f"{f.path}: {f.message}" for f in bad[:3]))


run(main, snakemake)  # noqa: F821
