import logging

from draftsmith.smk import run, to_console
from draftsmith.vllm_stack.preflight import count_samples, count_tokens, run_preflight


def main(smk):
    report = run_preflight(smk.config, smk.params.target["model"], tokens=count_tokens(smk.input.stats),
                           samples=count_samples(smk.input.stats))
    log = logging.getLogger("draftsmith.vllm_stack.preflight")
    for line in report.lines():
        log.info(line)
    verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    to_console([*report.lines(), f"preflight: {verdict} (log: {smk.log[0]})"])
    if not report.ok:
        raise SystemExit("preflight found problems:\n" + "\n".join(report.problems))


run(main, snakemake)  # noqa: F821
