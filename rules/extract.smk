rule extract_hidden_states:
    input:
        samples=R / "prepared" / "{dataset}" / "samples.parquet",
        stats=R / "prepared" / "{dataset}" / "stats.json",
        target=target_input(),
    output:
        manifest=R / "shards" / "{dataset}" / "shard_{shard}" / "manifest.json",
    log:
        R / "logs" / "extract_hidden_states" / "{dataset}" / "shard_{shard}.log",
    benchmark:
        R / "benchmarks" / "extract_hidden_states" / "{dataset}" / "shard_{shard}.tsv"
    priority: dataset_priority
    conda:
        "../envs/vllm.yaml"
        if config["extraction"]["backend"] == "vllm"
        else "../envs/core.yaml"
    threads: extraction_threads()
    resources:
        gpu=extraction_gpus(),
        mem_mb=16000,
    params:
        target=target_spec(config["extraction"]["dtype"]),
        extraction=job_settings("extraction", config["extraction"]["backend"]),
        seq_length=config["seq_length"],
    script:
        "../scripts/extract_hidden_states.py"
