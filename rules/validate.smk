# On demand: `snakemake validate` checks the whole results tree (never cached: it has no output).
rule validate:
    log:
        "logs/validate.log",
    benchmark:
        "benchmarks/validate.tsv"
    params:
        results=str(R),
    resources:
        gpu=0,
        mem_mb=4000,
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/validate.py"
