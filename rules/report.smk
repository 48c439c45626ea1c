rule report:
    input:
        summaries=expand(
            R / "benchmark" / "{variant}" / "summary.json", variant=VARIANTS
        ),
        per_prompt=expand(
            R / "benchmark" / "{variant}" / "per_prompt.csv", variant=VARIANTS
        ),
        metrics=expand(R / "draft" / "{variant}" / "metrics.csv", variant=VARIANTS),
        drafts=expand(R / "draft" / "{variant}" / "config.json", variant=VARIANTS),
        training_data=expand(
            R / "draft" / "{variant}" / "training_data.json", variant=VARIANTS
        ),
        prompts=R / "benchmark" / "prompts.jsonl",
        stats=expand(R / "prepared" / "{dataset}" / "stats.json", dataset=DATASETS),
        manifests=all_shard_manifests,
        # benchmark.offline_reference: the offline run beside the vllm one (rule benchmark_offline_reference)
        reference=(
            expand(
                R / "benchmark" / "{variant}" / "offline" / "summary.json",
                variant=VARIANTS,
            )
            if config["benchmark"]["backend"] == "vllm"
            and config["benchmark"]["offline_reference"]
            else []
        ),
    output:
        html=R / "report" / "report.html",
        md=R / "report" / "report.md",
        # the learning curve as data (draftsmith.report.learning_curve)
        curve=R / "report" / "learning_curve.csv",
        figures=report(
            directory(R / "report" / "figures"),
            patterns=["{name}.png"],
            caption="../docs/report_caption.rst",
            category="Figures",
        ),
    log:
        R / "logs" / "report.log",
    benchmark:
        R / "benchmarks" / "report.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=4000,
    params:
        config=canonical(config),
        # each rule's benchmark file, for the report's time per stage (written by the jobs of the inputs above)
        benchmarks=str(R / "benchmarks"),
        # the variants in the config's order, the report's order (config above has its keys sorted)
        variants=list(config["variants"]),
    script:
        "../scripts/report.py"
