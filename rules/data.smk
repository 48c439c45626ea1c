rule make_synthetic_corpus:
    output:
        train=R / "data" / "synthetic" / "train.jsonl",
        heldout=R / "data" / "synthetic" / "heldout.jsonl",
    params:
        synthetic=canonical(config.get("synthetic", {})),
    log:
        "logs/make_synthetic_corpus.log",
    benchmark:
        "benchmarks/make_synthetic_corpus.tsv"
    resources:
        gpu=0,
        mem_mb=1000,
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/make_synthetic_corpus.py"


rule build_target:
    input:
        train=R / "data" / "synthetic" / "train.jsonl",
    output:
        directory(R / "target"),
    params:
        embedded_target=canonical(config.get("embedded_target", {})),
    log:
        "logs/build_target.log",
    benchmark:
        "benchmarks/build_target.tsv"
    threads: workflow.cores
    resources:
        gpu=0,
        mem_mb=4000,
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/build_target.py"


rule prepare_dataset:
    input:
        data=dataset_input,
        target=target_input(),
    output:
        samples=R / "prepared" / "{dataset}" / "samples.parquet",
        stats=R / "prepared" / "{dataset}" / "stats.json",
    params:
        spec=lambda wc: dataset_spec(wc.dataset),
        target=target_param,
        trust_remote_code=config["target"].get("trust_remote_code", False),
        revision=config["target"].get("revision"),
        seq_length=config["seq_length"],
    log:
        "logs/prepare_dataset/{dataset}.log",
    benchmark:
        "benchmarks/prepare_dataset/{dataset}.tsv"
    resources:
        gpu=0,
        mem_mb=8000,
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/prepare_dataset.py"
