from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.trainer import train_draft


def main(smk):
    train_draft(
        manifests=list(smk.input.manifests),
        d2t=smk.input.d2t,
        t2d=smk.input.t2d,
        target=TargetSpec.from_dict(smk.params.target),
        training=smk.params.training,
        state_dir=smk.params.state_dir,
        variant=smk.wildcards.variant,
        gpus=smk.params.gpus,
        out_config=smk.output.config,
        out_weights=smk.output.weights,
        out_metrics=smk.output.metrics,
        out_data=smk.output.data,
    )


run(main, snakemake)  # noqa: F821
