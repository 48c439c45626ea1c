# On demand: `snakemake validate` checks the whole results tree (never cached: it has no output).
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
    script:
        "../scripts/validate.py"
