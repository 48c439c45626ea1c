# On demand: `snakemake validate` checks the whole results tree against the config: every output the config implies
# exists (prepared samples, shards, vocab map, drafts, benchmark results, report), each is intact, and each draft and
# benchmark was made from the current target, shards and vocab map. It has no output, so it runs every time it is
# asked; its verdict goes to the console and to the log.
rule validate:
    log:
        R / "logs" / "validate.log",
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=4000,
    script:
        "../scripts/validate.py"
