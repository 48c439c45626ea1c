from pathlib import Path

from draftsmith.extraction.driver import extract
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec


def main(smk):
    extract(
        samples_path=smk.input.samples,
        shard=int(smk.wildcards.shard),
        shard_dir=Path(smk.output.manifest).parent,
        target=TargetSpec.from_dict(smk.params.target),
        cfg=smk.params.extraction,
    )


run(main, snakemake)  # noqa: F821
