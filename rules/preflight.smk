# Seconds of checks (versions, vLLM call signatures, target config, layer ids, seq_length, shard count, GPUs, disk)
# before any weights load.
# It asks for the GPUs extraction asks for and runs in extraction's environment, so it checks what extraction gets.
# Extraction depends on its output through ancient(), so that re-running it does not re-extract.
rule preflight:
    input:
        stats=expand(R / "prepared" / "{dataset}" / "stats.json", dataset=DATASETS),
        target=target_input(),
    output:
        R / "preflight.json",
    log:
        "logs/preflight.log",
    benchmark:
        "benchmarks/preflight.tsv"
    conda:
        "../envs/vllm.yaml"
        if config["extraction"]["backend"] == "vllm"
        else "../envs/core.yaml"
    resources:
        gpu=extraction_gpus(),
        mem_mb=1000,
    params:
        config=canonical(
            {
                key: config[key]
                for key in (
                    "results",
                    "target",
                    "extraction",
                    "benchmark",
                    "vocab",
                    "seq_length",
                )
            }
        ),
        target=TARGET_SPEC,
    script:
        "../scripts/preflight.py"
