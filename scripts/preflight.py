import logging

from draftsmith.io import write_json
from draftsmith.smk import run
from draftsmith.vllm_stack.preflight import count_samples, count_tokens, run_preflight


def main(smk):
    report = run_preflight(smk.params.config, smk.params.target["model"], tokens=count_tokens(smk.input.stats),
                           samples=count_samples(smk.input.stats))
    log = logging.getLogger("draftsmith.vllm_stack.preflight")
    for line in report.lines():
        log.info(line)
    write_json(smk.output[0], report.to_dict())
    if not report.ok:
        raise RuntimeError("preflight found problems:\n" + "\n".join(report.problems))


run(main, snakemake)  # noqa: F821
