from draftsmith.data.prompts import read_benchmark_prompts
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec
from draftsmith.training.draft_model import resolve_num_speculative_tokens


def main(smk):
    cfg = {**smk.params.benchmark, "methods": list(smk.params.methods)}
    cfg["num_speculative_tokens"] = resolve_num_speculative_tokens(cfg["num_speculative_tokens"], smk.params.draft_dir)
    prompts = read_benchmark_prompts(smk.input.prompts)
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
