# The prompt set, written once: every variant and backend is measured on the same file, and the
# training data can be checked against it.
rule benchmark_prompts:
    input:
        by_content(benchmark_prompts_input()),
    output:
        R / "benchmark" / "prompts.jsonl",
    log:
        R / "logs" / "benchmark_prompts.log",
    benchmark:
        R / "benchmarks" / "benchmark_prompts.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=1000,
    params:
        spec=benchmark_prompts_spec(),
        content=content_of(benchmark_prompts_input()),
    script:
        "../scripts/benchmark_prompts.py"


rule benchmark:
    input:
        draft_config=R / "draft" / "{variant}" / "config.json",
        draft_weights=R / "draft" / "{variant}" / "model.safetensors",
        prompts=R / "benchmark" / "prompts.jsonl",
        target=target_input(),
        d2t=R / "vocab" / "d2t.npy",
        t2d=R / "vocab" / "t2d.npy",
    output:
        per_prompt=R / "benchmark" / "{variant}" / "per_prompt.csv",
        summary=R / "benchmark" / "{variant}" / "summary.json",
    log:
        R / "logs" / "benchmark" / "{variant}.log",
    benchmark:
        R / "benchmarks" / "benchmark" / "{variant}.tsv"
    priority: variant_priority
    conda:
        "../envs/vllm.yaml"
        if config["benchmark"]["backend"] == "vllm"
        else "../envs/core.yaml"
    threads: workflow.cores
    resources:
        gpu=benchmark_gpus(),
        mem_mb=16000,
    params:
        target=target_spec(config["benchmark"]["dtype"]),
        benchmark=benchmark_settings(config["benchmark"]["backend"]),
        draft_dir=lambda wc: str(R / "draft" / wc.variant),
        methods=lambda wc: variant_methods(wc.variant),
    script:
        "../scripts/benchmark.py"


# benchmark.offline_reference with backend vllm: the offline benchmark of the same draft on the same prompts, beside
# the vllm results, for the report's side-by-side comparison (draftsmith.report.backends).
rule benchmark_offline_reference:
    input:
        draft_config=R / "draft" / "{variant}" / "config.json",
        draft_weights=R / "draft" / "{variant}" / "model.safetensors",
        prompts=R / "benchmark" / "prompts.jsonl",
        target=target_input(),
        d2t=R / "vocab" / "d2t.npy",
        t2d=R / "vocab" / "t2d.npy",
    output:
        per_prompt=R / "benchmark" / "{variant}" / "offline" / "per_prompt.csv",
        summary=R / "benchmark" / "{variant}" / "offline" / "summary.json",
    log:
        R / "logs" / "benchmark" / "{variant}.offline_reference.log",
    benchmark:
        R / "benchmarks" / "benchmark" / "{variant}.offline_reference.tsv"
    conda:
        "../envs/core.yaml"
    threads: workflow.cores
    resources:
        gpu=single_device_gpus(config["benchmark"]["device"]),
        mem_mb=16000,
    params:
        target=target_spec(config["benchmark"]["dtype"]),
        # batch size 1, whatever sizes the vllm backend sweeps: the reference is compared prompt by prompt with the
        # vllm run's size-1 acceptance (per-request counters exist at size 1 only)
        benchmark=canonical(
            {
                **job_settings("benchmark", "offline"),
                "backend": "offline",
                "batch_sizes": [1],
            }
        ),
        draft_dir=lambda wc: str(R / "draft" / wc.variant),
        methods=lambda wc: variant_methods(wc.variant),
    script:
        "../scripts/benchmark.py"
