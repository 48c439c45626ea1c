from pathlib import Path

from draftsmith.extraction.driver import extract
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec
from draftsmith.preflight import gate


def main(smk):
    gate(smk.config, smk.params.target["model"], "extract", [smk.input.stats])
    extract(
        samples_path=smk.input.samples,
        shard=int(smk.wildcards.shard),
        shard_dir=Path(smk.output.manifest).parent,
        target=TargetSpec.from_dict(smk.params.target),
        cfg={**smk.config["extraction"], **smk.params.extraction},  # params hold the keys that change the shard
    )


# The guard matters with the vllm backend: where vLLM starts its workers with `spawn` (always on its CPU platform;
# on CUDA once CUDA is initialised), each worker re-runs this file as __mp_main__, where `snakemake` is undefined.
if __name__ == "__main__":
    run(main, snakemake)  # noqa: F821
