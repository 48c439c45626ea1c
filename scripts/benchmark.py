from draftsmith.prompts import load_prompts
from draftsmith.smk import run


def main(smk):
    cfg = dict(smk.params.benchmark)
    prompts_spec = cfg.get("prompts", "heldout")
    if prompts_spec == "heldout":
        if not smk.input.prompts:
            raise ValueError("benchmark.prompts is 'heldout' but the rule has no held-out prompts file as input")
        prompts_spec = smk.input.prompts[0]
    prompts = load_prompts(prompts_spec, cfg["num_prompts"])
    args = (smk.params.target, smk.params.draft_dir, prompts, cfg, smk.output.per_prompt, smk.output.summary,
            smk.wildcards.variant)
    target_options = {"trust_remote_code": smk.params.trust_remote_code, "revision": smk.params.revision}
    backend = cfg.get("backend", "offline")
    if backend == "offline":
        from draftsmith.offline_benchmark import run_offline_benchmark

        run_offline_benchmark(*args, **target_options)
    elif backend == "vllm":
        from draftsmith.vllm_benchmark import run_vllm_benchmark

        run_vllm_benchmark(*args, **target_options)
    else:
        raise ValueError(f"benchmark.backend = {backend!r}: use offline or vllm")


run(main, snakemake)  # noqa: F821
