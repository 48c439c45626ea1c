rule make_synthetic_corpus:
    output:
        train=R / "data" / "synthetic" / "train.jsonl",
        heldout=R / "data" / "synthetic" / "heldout.jsonl",
    log:
        R / "logs" / "make_synthetic_corpus.log",
    benchmark:
        R / "benchmarks" / "make_synthetic_corpus.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=1000,
    params:
        synthetic=canonical(config["synthetic"]),
    script:
        "../scripts/make_synthetic_corpus.py"


# One rule makes results/target, the one target.model names (BUILT_TARGETS in common.smk).
if TARGET_RULE == "import_target":

    rule import_target:
        input:
            gguf=ancient(packaged(locate_gguf)),
        output:
            directory(R / "target"),
        log:
            R / "logs" / "import_target.log",
        benchmark:
            R / "benchmarks" / "import_target.tsv"
        conda:
            "../envs/core.yaml"
        threads: workflow.cores
        resources:
            gpu=0,
            mem_mb=4000,
        params:
            model=config["target"]["model"],
            content=content_of([packaged(locate_gguf)]),
        script:
            "../scripts/import_target.py"

elif TARGET_RULE == "build_target":

    rule build_target:
        input:
            train=R / "data" / "synthetic" / "train.jsonl",
        output:
            directory(R / "target"),
        log:
            R / "logs" / "build_target.log",
        benchmark:
            R / "benchmarks" / "build_target.tsv"
        conda:
            "../envs/core.yaml"
        threads: workflow.cores
        resources:
            gpu=0,
            mem_mb=4000,
        params:
            embedded_target=canonical(config["embedded_target"]),
        script:
            "../scripts/build_target.py"


rule prepare_dataset:
    input:
        data=lambda wc: by_content(dataset_input(wc)),
        target=target_input(),
    output:
        samples=R / "prepared" / "{dataset}" / "samples.parquet",
        stats=R / "prepared" / "{dataset}" / "stats.json",
    log:
        R / "logs" / "prepare_dataset" / "{dataset}.log",
    benchmark:
        R / "benchmarks" / "prepare_dataset" / "{dataset}.tsv"
    priority: dataset_priority
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=8000,
    params:
        spec=lambda wc: dataset_spec(wc.dataset),
        # the data's bytes, not its mtime, decide a re-run (content_of in common.smk)
        content=lambda wc: content_of(dataset_input(wc)),
        target=TARGET_FILES_SPEC,
        seq_length=config["seq_length"],
    script:
        "../scripts/prepare_dataset.py"


# source self: the target writes the prompts itself (draftsmith/generation/self_prompts.py), with regenerate's backend
rule self_prompts:
    input:
        target=target_input(),
        # a prompt that is, or heavily overlaps, a benchmark prompt is dropped
        benchmark_questions=lambda wc: ancient(packaged(mt_bench_questions_file)),
    output:
        jsonl=R / "data" / "self" / "{dataset}.jsonl",
        # num_prompts asked, candidates sampled, dropped by reason (regenerate carries them into its stats)
        stats=R / "data" / "self" / "{dataset}.stats.json",
    log:
        R / "logs" / "self_prompts" / "{dataset}.log",
    benchmark:
        R / "benchmarks" / "self_prompts" / "{dataset}.tsv"
    priority: dataset_priority
    conda:
        "../envs/vllm.yaml"
        if config["regenerate"]["backend"] == "vllm"
        else "../envs/core.yaml"
    threads: max(1, workflow.cores // max(1, len(SELF_WRITTEN)))
    resources:
        gpu=regenerate_gpus(),
        mem_mb=8000,
    params:
        num_prompts=lambda wc: config["datasets"][wc.dataset]["num_prompts"],
        content=lambda wc: content_of([packaged(mt_bench_questions_file)]),
        self_prompts=job_settings("self_prompts"),
        target=target_spec(config["regenerate"]["dtype"]),
        # the backend and how it computes; chunk_size, batch_size, ... are read from the config at run time
        engine=self_prompts_engine(),
    script:
        "../scripts/self_prompts.py"


rule regenerate:
    input:
        data=lambda wc: by_content(regenerate_input(wc)),
        target=target_input(),
        # the benchmark's questions are never training prompts; resolved here, so that the job's own environment
        # (envs/vllm.yaml for the vllm backend) needs no data package
        benchmark_questions=lambda wc: ancient(packaged(mt_bench_questions_file)),
    output:
        jsonl=R / "data" / "regenerated" / "{dataset}.jsonl",
        # prompts read, dropped by reason, duplicates (prepare_dataset carries them into its stats.json)
        stats=R / "data" / "regenerated" / "{dataset}.stats.json",
    log:
        R / "logs" / "regenerate" / "{dataset}.log",
    benchmark:
        R / "benchmarks" / "regenerate" / "{dataset}.tsv"
    priority: dataset_priority
    conda:
        "../envs/vllm.yaml"
        if config["regenerate"]["backend"] == "vllm"
        else "../envs/core.yaml"
    # on a CPU the datasets generate side by side, one core each (two 1-thread jobs beat one 2-thread job)
    threads: max(1, workflow.cores // max(1, len(REGENERATED)))
    resources:
        gpu=regenerate_gpus(),
        mem_mb=8000,
    params:
        spec=lambda wc: raw_dataset_spec(wc.dataset),
        source=lambda wc: config["datasets"][wc.dataset]["source"],
        content=lambda wc: content_of(
            [*regenerate_input(wc), packaged(mt_bench_questions_file)]
        ),
        target=target_spec(config["regenerate"]["dtype"]),
        # the keys that change the answers (chunk_size, batch_size, ... are read from the config at run time)
        regenerate=job_settings("regenerate", config["regenerate"]["backend"]),
        seq_length=config["seq_length"],
    script:
        "../scripts/regenerate.py"
