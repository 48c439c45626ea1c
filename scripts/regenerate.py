from draftsmith.data.regenerated import read_regenerate_stats
from draftsmith.generation.driver import engine_device, regenerate
from draftsmith.generation.prompt_records import regeneration_prompts
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec


def main(smk):
    # params hold the keys that change the answers; the run-only ones (chunk_size, batch_size, ...) come from the config
    cfg = {**smk.config["regenerate"], **smk.params.regenerate}
    target = TargetSpec.from_dict(smk.params.target)
    device, dtype = engine_device(cfg, target)
    prompts = regeneration_prompts(dict(smk.params.spec), smk.params.source, smk.input.benchmark_questions)
    # prompts the target wrote itself: the counts of rule self_prompts go into these stats too
    written = read_regenerate_stats(smk.params.spec["path"], "self_prompts") if smk.params.source == "self" else None
    regenerate(prompts, target, smk.output.jsonl,
               backend=cfg["backend"], max_new_tokens=cfg["max_new_tokens"], batch_size=cfg["batch_size"],
               temperature=cfg["temperature"], top_p=cfg["top_p"], top_k=cfg["top_k"], seed=cfg["seed"],
               samples_per_prompt=cfg["samples_per_prompt"], chunk_size=cfg["chunk_size"], device=device, dtype=dtype,
               attention=cfg["attention"],
               tensor_parallel_size=cfg["tensor_parallel_size"], gpu_memory_utilization=cfg["gpu_memory_utilization"],
               max_model_len=cfg["max_model_len"], max_prompt_tokens=smk.params.seq_length,
               extra_stats={"self_prompts": written} if written is not None else None)


# The guard matters with the vllm backend: vLLM starts its engine and workers with `spawn` (always on its CPU platform;
# on CUDA once CUDA is initialised), and each re-runs this file as __mp_main__, where `snakemake` is undefined.
if __name__ == "__main__":
    run(main, snakemake)  # noqa: F821
