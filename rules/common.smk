import os
import shutil
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from draftsmith import artefacts
from draftsmith.config.batch_sizes import batch_sizes
from draftsmith.config.notices import benchmark_prompts_notice
from draftsmith.config.paths import resolve_paths
from draftsmith.config.sources import PROMPT_SETS
from draftsmith.config.workflow import (
    ConfigError,
    check_config,
    config_sources,
    merge_files,
)
from draftsmith.data.mtbench import (
    PromptDataError,
    fastchat_conversations_file,
    mt_bench_questions_file,
)
from draftsmith.data.prompt_sets import prompt_set_file
from draftsmith.data.regenerated import regenerate_stats_path
from draftsmith.fingerprints import ContentHashes, results_path
from draftsmith.provenance import target_content
from draftsmith.target_model.gguf import GGUFTargetError, locate_gguf

# Snakemake reads config files as plain YAML 1.1: a key given twice keeps the last silently, `1e-3` is a string.
# `config` is rebuilt from the same files read strictly (draftsmith.config.workflow), with --config entries on top;
# a file's datasets and variants replace the earlier files' (Snakemake would add them to it), whatever the order;
# relative paths resolve against the folder of the file that sets them (said once, on the console).
# check_config names each problem by file and key (one line each); validate then fills in the defaults.
try:
    merged_config = merge_files(
        workflow.configfiles,
        workflow.config_settings.config,
        default=Path(workflow.basedir) / "config" / "config.yaml",
    )
    path_notes = resolve_paths(merged_config, config_sources(workflow.configfiles))
    if workflow.is_main_process and path_notes:
        print("\n".join(path_notes), file=sys.stderr)
    config_problems = check_config(merged_config, workflow.configfiles)
    if config_problems:
        raise ConfigError("\n".join(config_problems))
except ConfigError as e:
    raise WorkflowError(str(e)) from None
config.clear()
config.update(merged_config)
validate(config, "../config/schema/config.schema.yaml")
prompts_notice = benchmark_prompts_notice(config, workflow.configfiles)
if workflow.is_main_process and prompts_notice:
    print(prompts_notice, file=sys.stderr)

# Jobs import the draftsmith package from this checkout, whatever environment runs them
# (a conda env from --sdm conda does not have it installed). Set here, not required from the user.
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        p for p in (workflow.basedir, os.environ.get("PYTHONPATH")) if p
    )
)

# One spelling of the results tree for Snakemake, which keys its records of each output by it
# (draftsmith.fingerprints.results_path); config["results"] says the same, for the report and validate.
R = results_path(config["results"])
config["results"] = str(R)
# sha256 of the inputs from outside the results tree (draftsmith.fingerprints), cached in R/.draftsmith
CONTENT = ContentHashes(R)
# Targets the workflow makes itself, into R / "target": "embedded" is pretrained by rule build_target,
# the packaged SmolLM2 is imported from its GGUF by rule import_target.
TARGET_RULE = artefacts.BUILT_TARGETS.get(config["target"]["model"])
DATASETS = sorted(config["datasets"])
REGENERATED = [d for d in DATASETS if config["datasets"][d]["regenerate"]]
# datasets whose prompts the target writes (rule self_prompts); check_config has made them regenerated
SELF_WRITTEN = [d for d in DATASETS if config["datasets"][d]["source"] == "self"]
VARIANTS = sorted(config["variants"])
for name in VARIANTS:
    unknown = set(config["variants"][name].get("datasets", [])) - set(DATASETS)
    if unknown:
        raise WorkflowError(
            f"variants.{name}.datasets: {sorted(unknown)} are not in datasets ({', '.join(DATASETS)})"
        )
if (
    config["benchmark"]["mt_bench"]["turns"] == 2
    and config["benchmark"]["backend"] != "offline"
):
    raise WorkflowError(
        "benchmark.mt_bench.turns: 2 runs on the offline backend only (the second turn is asked after the "
        "target's own answer to the first); set benchmark.backend: offline or turns: 1"
    )
if (
    REGENERATED
    and config["regenerate"]["samples_per_prompt"] > 1
    and config["regenerate"]["temperature"] == 0
):
    raise WorkflowError(
        f"regenerate.samples_per_prompt: {config['regenerate']['samples_per_prompt']} answers per prompt need "
        "sampling (with temperature 0 every answer is the same); set regenerate.temperature above 0, or "
        "samples_per_prompt: 1"
    )
NUM_SHARDS = config["extraction"]["num_shards"]


wildcard_constraints:
    dataset="|".join(DATASETS),
    variant="|".join(VARIANTS),
    shard=r"\d+",


def canonical(value):
    """Params with dict keys in sorted order: Snakemake compares params by their repr, so the key
    order of a YAML file must not make a step look changed."""
    if isinstance(value, dict):
        return {k: canonical(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


# The target spec each job that loads the target gets (draftsmith.target_model.spec.TargetSpec.from_dict):
# the built directory when embedded. A plain value, not a function of the job's input: Snakemake compares
# params it can evaluate while building the DAG, so a changed revision or trust_remote_code re-runs them.
# "content" (draftsmith.provenance.target_content; TargetSpec ignores it) stands for the target's files, so that
# a target directory changed in place re-runs every rule that loads it.
TARGET_MODEL = str(R / "target") if TARGET_RULE else config["target"]["model"]
TARGET_SPEC = canonical(
    {
        "model": TARGET_MODEL,
        "revision": config["target"]["revision"],
        "trust_remote_code": config["target"]["trust_remote_code"],
        "dtype": config["target"]["dtype"],
        "content": target_content(
            TARGET_MODEL, config["target"]["revision"], bool(TARGET_RULE), CONTENT
        ),
    }
)
# Rules that read only the target's tokenizer or config.json: its dtype (the weights') does not change their output.
TARGET_FILES_SPEC = {k: v for k, v in TARGET_SPEC.items() if k != "dtype"}
CONTENT.save()


def target_spec(stage_dtype):
    """TARGET_SPEC for a job that loads the weights in its section's dtype; target.dtype counts only where that
    is auto (TargetSpec.stage_dtype)."""
    return TARGET_SPEC if stage_dtype == "auto" else {**TARGET_SPEC, "dtype": "auto"}


def job_settings(section, backend=None):
    """A config section as a rule's params: only the keys that change the rule's output, so that a changed key
    re-runs exactly the jobs whose outputs depend on it. Left out (jobs read them from the config at run time):
    keys that only decide how a job runs (RUN_ONLY), those of the other backend, and those the job reads through
    an input file (SETTLED_BY_INPUT). tests/test_rebuilds.py holds every schema key to this.
    """
    leave_out = RUN_ONLY.get(section, set()) | SETTLED_BY_INPUT.get(section, set())
    if backend is not None:
        leave_out |= {
            key
            for other, keys in BACKEND_ONLY[section].items()
            if other != backend
            for key in keys
        }
    return canonical({k: v for k, v in config[section].items() if k not in leave_out})


def benchmark_settings(backend):
    """job_settings of the benchmark section with batch_sizes as the sizes it measures (draftsmith.benchmark.
    batch_sizes): null and the one size it stands for (concurrency, or batch_size offline) are the same run.
    """
    settings = job_settings("benchmark", backend)
    return canonical(
        {**settings, "batch_sizes": batch_sizes(config["benchmark"], backend)}
    )


RUN_ONLY = {
    "extraction": {"writer_threads"},
    # each answer depends on its prompt and its seed (seed, prompt id, sample), not on how the prompts are grouped
    # into chunks, batches or GPUs (draftsmith.generation.driver)
    "regenerate": {
        "chunk_size",
        "batch_size",
        "tensor_parallel_size",
        "gpu_memory_utilization",
    },
    "benchmark": {"port", "server_timeout_s"},
    "training": {"resume"},
}
BACKEND_ONLY = {
    "regenerate": {
        "hf": {"device", "attention"},
        "vllm": {"max_model_len", "tensor_parallel_size", "gpu_memory_utilization"},
    },
    "extraction": {
        "hf": {"batch_tokens", "max_batch_size", "device"},
        "vllm": {
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "max_model_len",
            "batch_size",
        },
    },
    "benchmark": {
        "offline": {"cuda_graphs", "device", "batch_size", "repeats"},
        "vllm": {
            "concurrency",
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "max_model_len",
            "offline_reference",
            "cpu_test_worker",
        },
    },
}
# the benchmark reads its prompts from rule benchmark_prompts' file, made from these
SETTLED_BY_INPUT = {"benchmark": {"prompts", "num_prompts", "mt_bench"}}
HUB_ONLY = ("name", "subset", "split", "revision")
# regenerate's keys that change how the target answers, not how it writes its own prompts (rule self_prompts)
ANSWER_ONLY = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "samples_per_prompt",
}


def self_prompts_engine():
    """The regenerate keys that change a self-written prompt: the backend and how it computes (dtype, device,
    max_model_len), not the answers' sampling."""
    settings = job_settings("regenerate", config["regenerate"]["backend"])
    return {k: v for k, v in settings.items() if k not in ANSWER_ONLY}


def respell(path):
    raise WorkflowError(
        f"{os.path.realpath(R)}/{path}: the results tree is {R} for Snakemake (relative to the working directory): "
        f"name the file {R / path}"
    )


def outside_results(path):
    return not Path(os.path.realpath(path)).is_relative_to(os.path.realpath(R))


def by_content(paths):
    """Inputs as Snakemake should see them: one from outside the results tree with its mtime ignored (`ancient`): its
    content decides, through content_of in the rule's params. A touch or a copy without -p re-runs nothing.
    """
    return [ancient(p) if outside_results(p) else p for p in paths]


def content_of(paths):
    """The sha256 of each input from outside the results tree, by path (a rule's `content` param)."""
    digests = {str(p): CONTENT.fingerprint(p) for p in paths if outside_results(p)}
    CONTENT.save()
    return digests


def target_input():
    """The target as a file dependency when the workflow builds it."""
    return [str(R / "target")] if TARGET_RULE else []


def packaged(locate):
    """A data file of an installed package, found while the DAG is built: a missing package stops the
    workflow before any job runs, with the command that installs it."""
    try:
        return str(locate())
    except (GGUFTargetError, PromptDataError) as e:
        raise WorkflowError(str(e)) from None


def raw_dataset_spec(dataset):
    """The dataset as prepare_dataset (or regenerate) reads it: files the workflow or a package provides
    become source=local."""
    spec = dict(config["datasets"][dataset])
    spec.pop("keep_cut_answers", None)  # prepare_dataset's alone (dataset_spec)
    # keys of another source do not change what is read (rule self_prompts reads num_prompts; the prompts it writes
    # are read through their file)
    for key in (
        (*HUB_ONLY, "num_prompts")
        if spec["source"] != "hub"
        else ("path", "num_prompts")
    ):
        spec.pop(key, None)
    if spec["source"] == "synthetic":
        spec.update(source="local", path=str(R / "data" / "synthetic" / "train.jsonl"))
    elif spec["source"] == "fastchat":
        spec.update(source="local", path=packaged(fastchat_conversations_file))
    elif spec["source"] == "self":
        spec.update(source="local", path=str(self_prompts_path(dataset)))
    elif spec["source"] in PROMPT_SETS:
        prompt_set = spec["source"]
        spec.update(source="local", path=packaged(lambda: prompt_set_file(prompt_set)))
    return canonical(spec)


def self_prompts_path(dataset):
    return R / "data" / "self" / f"{dataset}.jsonl"


def regenerated_path(dataset):
    return R / "data" / "regenerated" / f"{dataset}.jsonl"


def dataset_spec(dataset):
    """What prepare_dataset reads: the target's own answers for a regenerated dataset, else the raw data; and
    keep_cut_answers where it is false (where true, the spec stays as it was before the key existed).
    """
    if dataset in REGENERATED:
        spec = {
            "source": "local",
            "path": str(regenerated_path(dataset)),
            "max_records": None,
        }
    else:
        spec = raw_dataset_spec(dataset)
    if not config["datasets"][dataset].get("keep_cut_answers", True):
        spec = canonical({**spec, "keep_cut_answers": False})
    return spec


def local_input(spec):
    return [spec["path"]] if spec["source"] == "local" else []


def dataset_input(wildcards):
    """The file prepare_dataset reads; for a regenerated dataset also regenerate's stats beside it."""
    files = local_input(dataset_spec(wildcards.dataset))
    if wildcards.dataset in REGENERATED:
        files.append(str(regenerate_stats_path(regenerated_path(wildcards.dataset))))
    return files


def regenerate_input(wildcards):
    """The prompts regenerate answers; for a dataset of source self also the stats beside them (regenerate carries
    them into its own)."""
    files = local_input(raw_dataset_spec(wildcards.dataset))
    if wildcards.dataset in SELF_WRITTEN:
        files.append(str(regenerate_stats_path(self_prompts_path(wildcards.dataset))))
    return files


def all_shard_manifests(wildcards=None):
    return [
        str(m)
        for m in artefacts.expected_outputs(config).get("extract_hidden_states", [])
    ]


def variant_manifests(wildcards):
    """The shards a variant trains on: those of its `datasets`, else of every dataset (none online)."""
    return [str(m) for m in artefacts.variant_manifests(config, wildcards.variant)]


def variant_samples(wildcards):
    """The prepared samples an online variant trains on (training.hidden_states: online; none offline)."""
    return [str(m) for m in artefacts.variant_samples(config, wildcards.variant)]


def training_states():
    """train_draft's hidden-state source as its params: online, the extraction keys that set the states the target
    computes in the job (artefacts.ONLINE_SETTINGS); offline nothing (the shards carry them).
    """
    if not artefacts.online_states(config):
        return {"mode": "offline"}
    settings = {k: config["extraction"][k] for k in artefacts.ONLINE_SETTINGS}
    return canonical({"mode": "online", **settings})


def variant_training(variant):
    overrides = dict(config["variants"][variant])
    overrides.pop("benchmark_methods", None)
    overrides.pop("datasets", None)
    return canonical({**job_settings("training"), **overrides})


def variant_methods(variant):
    """The benchmark methods of a variant, target_greedy (the reference) first."""
    methods = config["variants"][variant].get(
        "benchmark_methods", config["benchmark"]["methods"]
    )
    return ["target_greedy", *(m for m in methods if m != "target_greedy")]


def benchmark_prompts_spec():
    """benchmark.prompts resolved to what the benchmark_prompts rule reads (mt_bench's subset size fixed)."""
    bench = config["benchmark"]
    prompts = bench["prompts"]
    if prompts == "mt_bench":
        per_category = bench["mt_bench"]["per_category"]
        if per_category == "auto":
            per_category = 1 if benchmark_gpus() == 0 else None
        return canonical(
            {
                "source": "mt_bench",
                "path": packaged(mt_bench_questions_file),
                "per_category": per_category,
                "seed": bench["mt_bench"]["seed"],
                "turns": bench["mt_bench"]["turns"],
            }
        )
    if prompts == "heldout":
        return {
            "source": "heldout",
            "path": str(R / "data" / "synthetic" / "heldout.jsonl"),
            "num_prompts": bench["num_prompts"],
        }
    return canonical({**prompts, "num_prompts": bench["num_prompts"]})


def benchmark_prompts_input():
    spec = benchmark_prompts_spec()
    return [spec["path"]] if spec["source"] != "hub" else []


def single_device_gpus(device):
    """GPUs a one-device job asks for: none on "cpu", one on "cuda[:N]", one on "auto" where a GPU exists."""
    if device == "cpu":
        return 0
    return 1 if device.startswith("cuda") or shutil.which("nvidia-smi") else 0


def extraction_gpus():
    ext = config["extraction"]
    if ext["backend"] == "vllm":
        return ext["tensor_parallel_size"]
    return single_device_gpus(ext["device"])


def extraction_threads():
    """CPU threads of an extraction job: on a CPU its forward passes use them all (split among the shards); on a GPU it
    needs its writer threads and one to feed the device, so CPU jobs of other datasets (prepare_dataset, token_freq,
    vocab_map) run beside it instead of leaving the GPU idle afterwards."""
    if extraction_gpus() > 0:
        return min(workflow.cores, config["extraction"]["writer_threads"] + 2)
    return max(1, workflow.cores // max(1, NUM_SHARDS))


def dataset_priority(wildcards):
    """Target-written datasets first: theirs is the longest chain (write prompts, answer them, prepare, extract), so it
    starts at once rather than after every other dataset's jobs."""
    return 1 if config["datasets"][wildcards.dataset]["source"] == "self" else 0


def variant_priority(wildcards):
    """Variants are trained and benchmarked in the order the config lists them (the first highest), so a run cut short
    has the first ones' results: list the main recipe first, then the comparisons. Snakemake's --prioritize would
    instead give every job the target needs the same top priority, undoing dataset_priority.
    """
    names = list(config["variants"])
    return len(names) - names.index(wildcards.variant)


def regenerate_gpus():
    regen = config["regenerate"]
    if regen["backend"] == "vllm":
        return regen["tensor_parallel_size"]
    return single_device_gpus(regen["device"])


def benchmark_gpus():
    bench = config["benchmark"]
    if bench["backend"] == "vllm":
        return bench["tensor_parallel_size"]
    return single_device_gpus(bench["device"])


def training_gpus(variant):
    """training.gpus; 0 means one GPU where one exists (extraction.device: cpu keeps it on the CPU). A dry run on this
    machine stops here on a count it cannot give (--resources gpu=N where given, else the visible GPUs), naming the
    key: a real run's own check (onstart) does not run in a dry run."""
    if workflow.dryrun and workflow.local_exec:
        declared = workflow.global_resources.get("gpu")
        problems = gpu_problems({"train_draft"}, declared.value if declared else None)
        if problems:
            raise WorkflowError("\n".join(problems))
    gpus = variant_training(variant)["gpus"]
    return gpus or single_device_gpus(config["extraction"]["device"])


# the preflight stage whose GPU count each GPU rule asks for (draftsmith.preflight.STAGES; regenerate has
# no preflight stage of its own: preflight.machine.gpu_problems checks it alone)
GPU_STAGE = {
    "self_prompts": "regenerate",
    "regenerate": "regenerate",
    "extract_hidden_states": "extract",
    "train_draft": "train",
    "benchmark": "benchmark",
}


def gpu_problems(rules, gpus=None):
    """One line per GPU count, asked for by a stage among `rules`, that this machine (or `gpus`) cannot give (naming
    the key)."""
    from draftsmith.preflight.machine import gpu_problems as check

    return check(config, {GPU_STAGE[r] for r in rules if r in GPU_STAGE}, gpus)


def all_outputs():
    """Rule all's inputs: every output of the DAG (draftsmith.artefacts), intermediates too, because Snakemake 9
    rebuilds a missing intermediate only when a job after it must run: listed here, a deleted vocab map or shard
    is rebuilt by a plain `snakemake`, and what depends on it re-runs."""
    return [
        str(p) for paths in artefacts.expected_outputs(config).values() for p in paths
    ]
