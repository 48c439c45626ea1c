from draftsmith.data.prompts import read_benchmark_prompts
from draftsmith.draft_model import resolve_num_speculative_tokens
from draftsmith.provenance import benchmark_inputs, record_inputs
from draftsmith.smk import run
from draftsmith.target_model.spec import TargetSpec
from draftsmith.preflight import gate


def main(smk):
    target = TargetSpec.from_dict(smk.params.target)
    # params hold the keys that change the results, the config adds how to run (port, timeouts); this job's own
    # backend comes from params: benchmark_offline_reference runs the offline backend beside a vllm config
    bench = {**smk.config["benchmark"], **smk.params.benchmark}
    gate({**smk.config, "benchmark": bench}, target.model, "benchmark")
    inputs = benchmark_inputs(smk.params.draft_dir, smk.input.prompts, target.fingerprint())
    cfg = {**bench, "methods": list(smk.params.methods)}
    cfg["num_speculative_tokens"] = resolve_num_speculative_tokens(cfg["num_speculative_tokens"], smk.params.draft_dir)
    prompts = read_benchmark_prompts(smk.input.prompts)
    args = (target, smk.params.draft_dir, prompts, cfg, smk.output.per_prompt,
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
    record_inputs(smk.output.summary, inputs)


run(main, snakemake)  # noqa: F821
