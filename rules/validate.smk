# On demand: `snakemake validate` checks the whole results tree and that every shard of the config
# (datasets x extraction.num_shards) exists (never cached: it has no output).
rule validate:
    log:
        "logs/validate.log",
    benchmark:
        "benchmarks/validate.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=4000,
    params:
        results=str(R),
        shards={dataset: NUM_SHARDS for dataset in DATASETS},
    script:
        "../scripts/validate.py"
