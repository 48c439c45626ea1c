from draftsmith.models import load_tokenizer
from draftsmith.smk import run
from draftsmith.tokenization import prepare_dataset


def main(smk):
    tokenizer = load_tokenizer(smk.params.target, smk.params.trust_remote_code, smk.params.revision)
    prepare_dataset(
        smk.params.spec,
        tokenizer,
        smk.params.seq_length,
        smk.output.samples,
        smk.output.stats,
        name=smk.wildcards.dataset,
    )


run(main, snakemake)  # noqa: F821
