from draftsmith.data.prompts import write_benchmark_prompts
from draftsmith.smk import run


def main(smk):
    write_benchmark_prompts(dict(smk.params.spec), smk.output[0])


run(main, snakemake)  # noqa: F821
