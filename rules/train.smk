rule train_draft:
    input:
        manifests=variant_manifests,
        samples=variant_samples,
        d2t=R / "vocab" / "d2t.npy",
        t2d=R / "vocab" / "t2d.npy",
        target=target_input(),
    output:
        config=R / "draft" / "{variant}" / "config.json",
        weights=R / "draft" / "{variant}" / "model.safetensors",
        metrics=R / "draft" / "{variant}" / "metrics.csv",
        data=R / "draft" / "{variant}" / "training_data.json",
    log:
        R / "logs" / "train_draft" / "{variant}.log",
    benchmark:
        R / "benchmarks" / "train_draft" / "{variant}.tsv"
    priority: variant_priority
    conda:
        "../envs/core.yaml"
    threads: workflow.cores
    resources:
        gpu=lambda wc: training_gpus(wc.variant),
        mem_mb=16000,
    params:
        # online, the job loads the target's weights in extraction.dtype (target.dtype where that is auto)
        target=(
            target_spec(config["extraction"]["dtype"])
            if config["training"]["hidden_states"] == "online"
            else TARGET_FILES_SPEC
        ),
        states=training_states(),
        training=lambda wc: variant_training(wc.variant),
        state_dir=lambda wc: str(R / "train_state" / wc.variant),
        gpus=lambda wc: training_gpus(wc.variant),
    script:
        "../scripts/train_draft.py"
