from draftsmith.data.tokenization import prepare_dataset
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec


def main(smk):
    prepare_dataset(
        smk.params.spec,
        TargetSpec.from_dict(smk.params.target).load_tokenizer(),
        smk.params.seq_length,
        smk.output.samples,
        smk.output.stats,
        name=smk.wildcards.dataset,
    )


run(main, snakemake)  # noqa: F821
