import os
import shutil
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from draftsmith.config.workflow import (
    ConfigError,
    read_config_file,
    replace_named_sections,
)

# Snakemake keeps the last of a key given twice in a config file, silently: re-read each file strictly.
# The user's datasets and variants replace the embedded default's (Snakemake would add them to it).
try:
    for configfile_path in workflow.configfiles:
        read_config_file(configfile_path)
    replace_named_sections(config, workflow.configfiles)
except ConfigError as e:
    raise WorkflowError(str(e)) from None

validate(config, "../config/schema/config.schema.yaml")

# Jobs import the draftsmith package from this checkout, whatever environment runs them
# (a conda env from --sdm conda does not have it installed). Set here, not required from the user.
os.environ.update(
    PYTHONPATH=os.pathsep.join(
        p for p in (workflow.basedir, os.environ.get("PYTHONPATH")) if p
    )
)

R = Path(config["results"])
EMBEDDED = config["target"]["model"] == "embedded"
DATASETS = sorted(config["datasets"])
VARIANTS = sorted(config["variants"])
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
TARGET_SPEC = canonical(
    {
        "model": str(R / "target") if EMBEDDED else config["target"]["model"],
        "revision": config["target"]["revision"],
        "trust_remote_code": config["target"]["trust_remote_code"],
        "dtype": config["target"]["dtype"],
    }
)


def target_input():
    """The target as a file dependency when the workflow builds it."""
    return [str(R / "target")] if EMBEDDED else []


def dataset_spec(dataset):
    spec = dict(config["datasets"][dataset])
    if spec["source"] == "synthetic":
        spec["path"] = str(R / "data" / "synthetic" / "train.jsonl")
    return canonical(spec)


def dataset_input(wildcards):
    spec = dataset_spec(wildcards.dataset)
    return [spec["path"]] if spec["source"] in ("synthetic", "local") else []


def shard_manifests(dataset):
    return [
        str(R / "shards" / dataset / f"shard_{k}" / "manifest.json")
        for k in range(NUM_SHARDS)
    ]


def all_shard_manifests(wildcards=None):
    return [m for d in DATASETS for m in shard_manifests(d)]


def variant_training(variant):
    return canonical({**config["training"], **config["variants"][variant]})


def benchmark_prompts_input():
    prompts = config["benchmark"]["prompts"]
    if prompts == "heldout":
        return [str(R / "data" / "synthetic" / "heldout.jsonl")]
    return [prompts["path"]] if prompts["source"] == "local" else []


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


def benchmark_gpus():
    bench = config["benchmark"]
    if bench["backend"] == "vllm":
        return bench["tensor_parallel_size"]
    return single_device_gpus(bench["device"])


def training_gpus(variant):
    """training.gpus; 0 means one GPU where one exists (extraction.device: cpu keeps it on the CPU)."""
    gpus = variant_training(variant)["gpus"]
    return gpus or single_device_gpus(config["extraction"]["device"])


def all_outputs():
    """Rule all's inputs. The shard manifests are among them because Snakemake 9 rebuilds a missing
    intermediate only when a job after it must run: listed here, a deleted shard directory is
    re-extracted by a plain `snakemake`, and what depends on it re-runs."""
    return [
        str(R / "report" / "report.html"),
        str(R / "report" / "report.md"),
        *all_shard_manifests(),
    ]
