from draftsmith.data.prompts import load_prompts
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec


def main(smk):
    cfg = dict(smk.params.benchmark)
    prompts_spec = cfg["prompts"]
    if prompts_spec == "heldout":
        if not smk.input.prompts:
            raise ValueError("benchmark.prompts is 'heldout' but the rule has no held-out prompts file as input")
        prompts_spec = smk.input.prompts[0]
    prompts = load_prompts(prompts_spec, cfg["num_prompts"])
    args = (TargetSpec.from_dict(smk.params.target), smk.params.draft_dir, prompts, cfg, smk.output.per_prompt,
            smk.output.summary, smk.wildcards.variant)
    backend = cfg["backend"]
    if backend == "offline":
        from draftsmith.benchmark.offline import run_offline_benchmark

        run_offline_benchmark(*args)
    elif backend == "vllm":
        from draftsmith.benchmark.vllm_benchmark import run_vllm_benchmark

        run_vllm_benchmark(*args)
    else:
        raise ValueError(f"benchmark.backend = {backend!r}: use offline or vllm")


run(main, snakemake)  # noqa: F821
