rule make_synthetic_corpus:
    output:
        train=R / "data" / "synthetic" / "train.jsonl",
        heldout=R / "data" / "synthetic" / "heldout.jsonl",
    log:
        "logs/make_synthetic_corpus.log",
    benchmark:
        "benchmarks/make_synthetic_corpus.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=1000,
    params:
        synthetic=canonical(config["synthetic"]),
    script:
        "../scripts/make_synthetic_corpus.py"


rule build_target:
    input:
        train=R / "data" / "synthetic" / "train.jsonl",
    output:
        directory(R / "target"),
    log:
        "logs/build_target.log",
    benchmark:
        "benchmarks/build_target.tsv"
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
        data=dataset_input,
        target=target_input(),
    output:
        samples=R / "prepared" / "{dataset}" / "samples.parquet",
        stats=R / "prepared" / "{dataset}" / "stats.json",
    log:
        "logs/prepare_dataset/{dataset}.log",
    benchmark:
        "benchmarks/prepare_dataset/{dataset}.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=8000,
    params:
        spec=lambda wc: dataset_spec(wc.dataset),
        target=TARGET_SPEC,
        seq_length=config["seq_length"],
    script:
        "../scripts/prepare_dataset.py"
