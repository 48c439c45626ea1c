rule benchmark:
    input:
        draft_config=R / "draft" / "{variant}" / "config.json",
        draft_weights=R / "draft" / "{variant}" / "model.safetensors",
        prompts=benchmark_prompts_input(),
        target=target_input(),
        d2t=R / "vocab" / "d2t.npy",
        t2d=R / "vocab" / "t2d.npy",
    output:
        per_prompt=R / "benchmark" / "{variant}" / "per_prompt.csv",
        summary=R / "benchmark" / "{variant}" / "summary.json",
    log:
        "logs/benchmark/{variant}.log",
    benchmark:
        "benchmarks/benchmark/{variant}.tsv"
    conda:
        "../envs/vllm.yaml"
        if config["benchmark"]["backend"] == "vllm"
        else "../envs/core.yaml"
    threads: workflow.cores
    resources:
        gpu=benchmark_gpus(),
        mem_mb=16000,
    params:
        target=TARGET_SPEC,
        benchmark=canonical(config["benchmark"]),
        draft_dir=lambda wc: str(R / "draft" / wc.variant),
    script:
        "../scripts/benchmark.py"
