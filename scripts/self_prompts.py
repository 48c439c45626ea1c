from draftsmith.generation.driver import engine_device
from draftsmith.generation.self_prompts import self_prompts
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec


def main(smk):
    # params hold the keys that change the prompts; the run-only ones (chunk_size, batch_size, ...) come from the config
    engine = {**smk.config["regenerate"], **smk.params.engine}
    target = TargetSpec.from_dict(smk.params.target)
    device, dtype = engine_device(engine, target)
    self_prompts(target, smk.output.jsonl, smk.params.num_prompts, name=smk.wildcards.dataset,
                 **smk.params.self_prompts, benchmark_questions=smk.input.benchmark_questions,
                 backend=engine["backend"], chunk_size=engine["chunk_size"], batch_size=engine["batch_size"],
                 device=device, dtype=dtype, attention=engine["attention"], tensor_parallel_size=engine["tensor_parallel_size"],
                 gpu_memory_utilization=engine["gpu_memory_utilization"], max_model_len=engine["max_model_len"])


# The guard matters with the vllm backend: vLLM starts its engine and workers with `spawn`, and each re-runs this file
# as __mp_main__, where `snakemake` is undefined.
if __name__ == "__main__":
    run(main, snakemake)  # noqa: F821
