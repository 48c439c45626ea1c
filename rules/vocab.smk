rule token_freq:
    input:
        samples=R / "prepared" / "{dataset}" / "samples.parquet",
    output:
        R / "vocab" / "{dataset}" / "token_freq.pt",
    log:
        R / "logs" / "token_freq" / "{dataset}.log",
    benchmark:
        R / "benchmarks" / "token_freq" / "{dataset}.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=4000,
    script:
        "../scripts/token_freq.py"


rule vocab_map:
    input:
        freqs=expand(R / "vocab" / "{dataset}" / "token_freq.pt", dataset=DATASETS),
        target=target_input(),
    output:
        combined=R / "vocab" / "token_freq.pt",
        d2t=R / "vocab" / "d2t.npy",
        t2d=R / "vocab" / "t2d.npy",
    log:
        R / "logs" / "vocab_map.log",
    benchmark:
        R / "benchmarks" / "vocab_map.tsv"
    conda:
        "../envs/core.yaml"
    resources:
        gpu=0,
        mem_mb=2000,
    params:
        draft_vocab_size=config["vocab"]["draft_vocab_size"],
        target=TARGET_FILES_SPEC,
    script:
        "../scripts/vocab_map.py"
