from draftsmith.smk import run
from draftsmith.target_model.gguf import import_gguf_target


def main(smk):
    import_gguf_target(smk.output[0])  # finds the packaged file itself (smk.input.gguf), recording the package


run(main, snakemake)  # noqa: F821
