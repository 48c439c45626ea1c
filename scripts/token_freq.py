from draftsmith.io import torch_save
from draftsmith.smk import run
from draftsmith.vocab import token_frequencies


def main(smk):
    torch_save(token_frequencies(smk.input.samples), smk.output[0])


run(main, snakemake)  # noqa: F821
