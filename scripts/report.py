from draftsmith.report.build import build_report
from draftsmith.smk import run


def main(smk):
    build_report(
        summaries=smk.input.summaries,
        per_prompt=smk.input.per_prompt,
        metrics=smk.input.metrics,
        drafts=smk.input.drafts,
        training_data=smk.input.training_data,
        stats=smk.input.stats,
        manifests=smk.input.manifests,
        config=smk.params.config,
        out_html=smk.output.html,
        out_md=smk.output.md,
        figures_dir=smk.output.figures,
        reference=smk.input.reference,
        out_csv=smk.output.curve,
        benchmarks=smk.params.benchmarks,
        variant_order=smk.params.variants,
    )


run(main, snakemake)  # noqa: F821
