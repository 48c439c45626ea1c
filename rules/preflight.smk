# On demand: `snakemake preflight` checks everything the config asks for (versions, vLLM call signatures, target
# config, layer ids, seq_length, shard count, every GPU count, disk) in seconds, before any weights load, and prints
# its verdict. It has no input and no output: it runs every time it is asked and plans no other job (a target the
# workflow builds and datasets not yet prepared are checked once they exist: it says so). It runs in extraction's
# environment with the GPUs extraction asks for. In a plain run nothing waits for it: each job that loads weights
# first runs the checks of its own stage (draftsmith.preflight.gate), so a changed setting re-runs exactly
# the jobs that read it.
rule preflight:
    log:
        R / "logs" / "preflight.log",
    conda:
        "../envs/vllm.yaml"
        if config["extraction"]["backend"] == "vllm"
        else "../envs/core.yaml"
    resources:
        gpu=extraction_gpus(),
        mem_mb=1000,
    script:
        "../scripts/preflight.py"
