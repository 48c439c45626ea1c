from pathlib import Path

from draftsmith.data.tokenization import prepare_dataset
from draftsmith.smk import run, to_console
from draftsmith.target_model.spec import TargetSpec


def main(smk):
    prepare_dataset(
        smk.params.spec,
        TargetSpec.from_dict(smk.params.target).load_tokenizer(),
        smk.params.seq_length,
        smk.output.samples,
        smk.output.stats,
        name=smk.wildcards.dataset,
        # beside the log, not a declared output: it outlives a failed job (Snakemake deletes a failed job's outputs)
        kept_stats_path=Path(smk.log[0]).with_suffix(".stats.json"),
        console=to_console,
    )


run(main, snakemake)  # noqa: F821
