"""Exactly-right rebuilds: after any change to a finished run, one plain `snakemake` plans exactly the jobs whose
outputs depend on it, and none else.

Every leaf key of the config schema is changed on the finished tiny run (tests/conftest.py), one at a time, and the
plan of a plain dry run is compared with the rules that read the key plus everything downstream of them. A key that
changes no output says why. The report shows the whole config, so it re-runs after every change."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO, jobs_planned, snakemake

# rule -> the rules that read its outputs, in the tiny configuration's DAG
READERS = {
    "make_synthetic_corpus": {"build_target", "prepare_dataset", "benchmark_prompts"},
    "build_target": {"prepare_dataset", "extract_hidden_states", "vocab_map", "train_draft", "benchmark"},
    "self_prompts": {"regenerate"},
    "regenerate": {"prepare_dataset"},
    "prepare_dataset": {"token_freq", "extract_hidden_states", "report"},
    "token_freq": {"vocab_map"},
    "vocab_map": {"train_draft", "benchmark"},
    "extract_hidden_states": {"train_draft", "report"},
    "train_draft": {"benchmark", "report"},
    "benchmark_prompts": {"benchmark", "report"},
    "benchmark": {"report"},
    "report": set(),
}
TARGET_LOADERS = {"prepare_dataset", "extract_hidden_states", "vocab_map", "train_draft", "benchmark"}
EVERYTHING = set(READERS) - {"self_prompts", "regenerate"}  # the tiny run answers no prompts

# key -> (new value, the rules that read it); a set() says the key changes no output here, and why
VLLM_ONLY = "read by the vllm backend only; this configuration uses hf extraction and the offline benchmark"
CHANGES = {
    "results": ("{tmp}/elsewhere", EVERYTHING),
    "target.model": ("{tmp}/target-copy", TARGET_LOADERS),  # build_target leaves the DAG
    "target.revision": ("v1", TARGET_LOADERS),
    "target.trust_remote_code": (True, TARGET_LOADERS),
    "target.dtype": ("bfloat16", set(), "extraction.dtype and benchmark.dtype are float32, so target.dtype is unused"),
    **{f"embedded_target.{k}": (v, {"build_target"}) for k, v in {
        "seed": 1, "vocab_size": 400, "hidden_size": 32, "intermediate_size": 96, "num_layers": 5, "num_heads": 2,
        "num_kv_heads": 1, "max_position_embeddings": 512, "pretrain_steps": 10, "pretrain_lr": 0.001,
        "pretrain_batch_size": 4, "pretrain_seq_len": 64}.items()},
    **{f"synthetic.{k}": (v, {"make_synthetic_corpus"}) for k, v in {"seed": 1, "num_records": 100, "num_heldout": 5}.items()},
    "datasets.synthetic.source": ("fastchat", {"prepare_dataset"}),
    "datasets.synthetic.path": ("{tmp}/other.jsonl", set(), "read for source local only"),
    **{f"datasets.synthetic.{k}": ("x", set(), "read for source hub only") for k in ("name", "subset", "split", "revision")},
    "datasets.synthetic.num_prompts": (5, set(), "read for source self only"),
    "datasets.synthetic.max_records": (50, {"prepare_dataset"}),
    "datasets.synthetic.keep_cut_answers": (False, {"prepare_dataset"}),
    "datasets.synthetic.regenerate": (True, {"regenerate", "prepare_dataset"}),
    **{f"regenerate.{k}": (v, set(), "no dataset of this configuration regenerates") for k, v in {
        "max_new_tokens": 8, "batch_size": 2, "temperature": 0.5, "top_p": 0.5, "top_k": 5, "seed": 1, "chunk_size": 2,
        "device": "cpu", "dtype": "float32", "backend": "vllm", "samples_per_prompt": 2, "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.5, "max_model_len": 512, "attention": "sdpa"}.items()},
    **{f"self_prompts.{k}": (v, set(), "no dataset of this configuration has source self") for k, v in {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1, "max_new_tokens": 64, "min_words": 5,
        "max_words": 100, "max_benchmark_overlap": 0.8, "max_candidates_factor": 2}.items()},
    "seq_length": (192, {"prepare_dataset", "extract_hidden_states"}),
    "extraction.backend": ("vllm", {"extract_hidden_states"}),
    **{f"extraction.{k}": (v, {"extract_hidden_states"}) for k, v in {
        "num_shards": 3, "batch_tokens": 1024, "max_batch_size": 8, "aux_layer_ids": [1, 2, 4], "device": "auto",
        "dtype": "bfloat16"}.items()},
    "extraction.writer_threads": (1, set(), "threads that write finished files: the bytes do not change"),
    **{f"extraction.{k}": (v, set(), VLLM_ONLY) for k, v in {
        "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_model_len": 512, "batch_size": 8}.items()},
    "vocab.draft_vocab_size": (128, {"vocab_map"}),
    **{f"training.{k}": (v, {"train_draft"}) for k, v in {
        "draft_layers": 2, "ttt_steps": 3, "ttt_step_loss_decay": 0.5, "lr": 0.001, "epochs": 3,
        "total_seq_length": 384, "scheduler": "cosine", "warmup_steps": 2, "noise_std": 0.0, "tf32": False,
        "val_fraction": 0.2, "data_fraction": 0.5, "seed": 1, "gpus": 1}.items()},
    "training.hidden_states": ("online", {"train_draft"}),  # the shards leave the DAG; nothing is extracted
    "training.compile": ("forward", {"train_draft"}),  # on a GPU the draft's numerics (fused or not); a CPU compiles nothing
    "training.resume": (False, set(), "says whether an interrupted run continues; resumed training is bit-identical"),
    **{f"variants.default.{k}": (v, {"train_draft"}) for k, v in {
        "draft_layers": 2, "ttt_steps": 3, "ttt_step_loss_decay": 0.5, "lr": 0.001, "epochs": 3, "noise_std": 0.0,
        "data_fraction": 0.5, "seed": 1}.items()},
    "variants.default.datasets": (["synthetic"], set(), "synthetic is the only dataset: the default trains on it too"),
    "variants.default.benchmark_methods": (["target_greedy", "eagle3_draft"], {"benchmark"}),
    "benchmark.backend": ("vllm", {"benchmark"}),
    **{f"benchmark.{k}": (v, {"benchmark"}) for k, v in {
        "num_speculative_tokens": 1, "max_new_tokens": 8, "methods": ["target_greedy", "eagle3_draft"],
        "batch_size": 2, "prompt_lookup_ngram": 2, "hybrid_min_ngram": 2, "load_requests_per_row": 2, "refill_rounds": 0.5,
        "cuda_graphs": False,
        "attention": "sdpa", "device": "auto", "dtype": "bfloat16",
        "seed": 1}.items()},
    "benchmark.repeats": (3, {"benchmark"}),
    # the sizes measured are the params (draftsmith.config.batch_sizes): null stands for [batch_size] offline, and
    # a size above 1 is a config error there (batched offline speculative decoding is not built)
    "benchmark.batch_sizes": ([1], set(), "[1] is the one size null stands for on the offline backend: the same run"),  # the tiny configuration times 2 runs per prompt
    "benchmark.num_prompts": (2, {"benchmark_prompts"}),
    "benchmark.prompts": ("mt_bench", {"benchmark_prompts"}),
    **{f"benchmark.mt_bench.{k}": (v, set(), "read for benchmark.prompts mt_bench only; this configuration uses heldout")
       for k, v in {"per_category": 2, "seed": 1, "turns": 2}.items()},
    "benchmark.temperature": (None, set(), "the schema allows only 0 (greedy is what is measured)"),
    **{f"benchmark.{k}": (v, set(), VLLM_ONLY) for k, v in {
        "concurrency": 2, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5, "max_model_len": 512,
        "offline_reference": True, "cpu_test_worker": True}.items()},
    **{f"benchmark.{k}": (v, set(), "how the vllm server is reached, not what it computes") for k, v in {
        "port": 20000, "server_timeout_s": 60}.items()},
}


@pytest.fixture(scope="module")
def run(up_to_date_run):
    """The session's finished tiny run, up to date."""
    return up_to_date_run


def schema_leaf_keys() -> set[str]:
    """Every leaf key of config/schema/config.schema.yaml, with datasets and variants as the tiny config names them."""
    schema = yaml.safe_load((REPO / "config" / "schema" / "config.schema.yaml").read_text())

    def leaves(node: dict, prefix: str) -> set[str]:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].split("/")[-1]]
        props = node.get("properties")
        if props and node.get("type") == "object":
            return set().union(*(leaves(v, f"{prefix}{k}.") for k, v in props.items()))
        if isinstance(node.get("additionalProperties"), dict):
            name = {"datasets": "synthetic", "variants": "default"}[prefix.rstrip(".")]
            return leaves(node["additionalProperties"], f"{prefix}{name}.")
        return {prefix.rstrip(".")}

    return leaves(schema, "")


def downstream(rules: set[str]) -> set[str]:
    out, todo = set(), list(rules)
    while todo:
        rule = todo.pop()
        if rule not in out:
            out.add(rule)
            todo += READERS[rule]
    return out


def test_every_schema_key_is_in_the_table():
    assert schema_leaf_keys() == set(CHANGES)


def set_key(config: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


CHANGED_KEYS = sorted(k for k in CHANGES if CHANGES[k][0] is not None)


def changed_value(key: str, tmp) -> object:
    value = CHANGES[key][0]
    return value.format(tmp=tmp) if isinstance(value, str) and "{tmp}" in value else value


@pytest.fixture(scope="module")
def plans(run, tmp_path_factory) -> dict[str, set[str]]:
    """key -> the rules one plain dry run plans after changing that key alone; two dry runs at a time (they
    only read the finished run, and a dry run takes no lock)."""
    from concurrent.futures import ThreadPoolExecutor

    def plan(key: str) -> set[str]:
        tmp = tmp_path_factory.mktemp(key.replace(".", "_"))
        config = yaml.safe_load((run / "config.yaml").read_text())
        value = changed_value(key, tmp)
        if key == "target.model":
            shutil.copytree(run / "results" / "target", value)
        set_key(config, key, value)
        (tmp / "changed.yaml").write_text(yaml.safe_dump(config))
        # --resources: the GPUs of the machine planned for (training.gpus: 1 fails a dry run on a machine without one)
        return set(jobs_planned(snakemake(run, "-n", "--resources", "gpu=2", "--configfile", str(tmp / "changed.yaml"))))

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(CHANGED_KEYS, pool.map(plan, CHANGED_KEYS)))


@pytest.mark.parametrize("key", CHANGED_KEYS)
def test_one_plain_run_after_a_change_reruns_exactly_what_depends_on_it(plans, key):
    value, direct, *why = CHANGES[key]
    expected = downstream(direct) | {"report", "all"}
    if key == "target.model":
        expected -= {"build_target"}
    assert plans[key] == expected, f"{key} = {value!r}: planned {sorted(plans[key])}, expected {sorted(expected)} {why}"


def test_a_target_changed_in_place_reruns_every_rule_that_loads_it(run, tmp_path):
    """results/target's weights rewritten in place (same size, new bytes): Snakemake sees no newer file, the target's
    content stands in the params of each rule that loads it."""
    weights = run / "results" / "target" / "model.safetensors"
    backup = tmp_path / "model.safetensors"
    shutil.copy2(weights, backup)
    try:
        data = bytearray(weights.read_bytes())
        data[-1] ^= 1
        weights.write_bytes(bytes(data))
        planned = set(jobs_planned(snakemake(run, "-n")))
    finally:
        shutil.copy2(backup, weights)  # mtime restored too, so the run is as it was
    assert planned == downstream(TARGET_LOADERS) | {"all"}
    assert "Nothing to be done" in snakemake(run, "-n").stdout


def test_target_content_stands_for_the_files_of_a_local_target(tmp_path):
    from draftsmith.fingerprints import ContentHashes
    from draftsmith.provenance import record_files, target_content

    target = tmp_path / "target"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"weights")
    (target / "config.json").write_text("{}")
    hashes = ContentHashes(tmp_path)
    local = target_content(str(target), None, False, hashes)
    assert target_content(str(target), None, False, hashes) == local  # stable while nothing changes
    (target / ".snakemake_timestamp").write_text("")  # dotfiles are not the model's
    os.utime(target / "model.safetensors", ns=(1, 1))  # nor are modification times
    assert target_content(str(target), None, False, hashes) == local
    shutil.copytree(target, tmp_path / "copy")  # a copy without -p: new mtimes, inodes and ctimes, the same bytes
    assert target_content(str(tmp_path / "copy"), None, False, hashes) == local
    (target / "model.safetensors").write_bytes(b"weightz")
    assert target_content(str(target), None, False, hashes) != local
    # a target the workflow built is "as built" until its files change, and before it exists
    assert target_content(str(tmp_path / "not-yet"), None, True, hashes) == "as built"
    record_files(target)
    assert target_content(str(target), None, True, hashes) == "as built"
    (target / "model.safetensors").write_bytes(b"WEIGHTS")
    assert target_content(str(target), None, True, hashes).startswith("files ")


def test_a_deleted_intermediate_is_rebuilt_by_a_plain_run(run, tmp_path):
    d2t = run / "results" / "vocab" / "d2t.npy"
    backup = tmp_path / "d2t.npy"
    shutil.copy2(d2t, backup)
    try:
        d2t.unlink()
        planned = set(jobs_planned(snakemake(run, "-n")))
    finally:
        shutil.copy2(backup, d2t)
    assert planned == downstream({"vocab_map"}) | {"all"}


# ----------------------------------------------------------------------------- regenerate's settings

# a dataset that regenerates: key -> (new value, whether regenerate re-runs). Settings that change an answer re-run
# it; those that change only how the answers are computed (chunks, batches, GPUs) or belong to the other backend do
# not (rules/common.smk: RUN_ONLY and BACKEND_ONLY for "regenerate")
REGENERATE_CHANGES = {
    "backend": ("vllm", True), "max_new_tokens": (3, True), "temperature": (0.7, True), "top_p": (0.5, True),
    "top_k": (5, True), "seed": (1, True), "samples_per_prompt": (2, True), "dtype": ("bfloat16", True),
    "device": ("auto", True), "attention": ("sdpa", True),
    "chunk_size": (3, False), "batch_size": (1, False), "tensor_parallel_size": (2, False),
    "gpu_memory_utilization": (0.5, False), "max_model_len": (64, False),
}


@pytest.fixture(scope="module")
def answered_run(tmp_path_factory):
    """The tiny configuration with two datasets the target answers, run up to their answers: `synthetic`
    regenerated (4 prompts) and `mine`, of source self (2 prompts of at most 16 tokens), each answered with 2 new
    tokens, sampled; returns (workdir, {dataset: its answers file})."""
    from conftest import write_config

    workdir = tmp_path_factory.mktemp("answered")
    write_config(workdir, {
        "embedded_target": {"pretrain_steps": 40},  # an untrained target seldom ends a turn
        "synthetic": {"num_records": 24, "num_heldout": 2},
        "datasets": {"synthetic": {"source": "synthetic", "regenerate": True, "max_records": 4},
                     "mine": {"source": "self", "num_prompts": 2, "regenerate": True}},
        "self_prompts": {"max_new_tokens": 16, "min_words": 1, "max_candidates_factor": 10},
        "regenerate": {"max_new_tokens": 2, "temperature": 0.5, "chunk_size": 2, "batch_size": 2, "device": "cpu",
                       "dtype": "float32"},
    })
    answers = {name: str(workdir / "results" / "data" / "regenerated" / f"{name}.jsonl") for name in ("synthetic", "mine")}
    snakemake(workdir, *answers.values())
    return workdir, answers


def wrong_plans(answered_run, dataset: str, changes: dict, tmp_path) -> list[str]:
    """Each key of `changes` (key -> (new value, the rules a plain run then re-runs)) changed alone in the answered
    run's config: the rules a dry run for `dataset`'s answers plans, where they are not the expected ones."""
    workdir, answers = answered_run
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    wrong = []
    for key, (value, reruns) in changes.items():
        changed_config = yaml.safe_load(yaml.safe_dump(config))
        set_key(changed_config, key, value)
        changed = tmp_path / f"{key}.yaml"
        changed.write_text(yaml.safe_dump(changed_config))
        planned = set(jobs_planned(snakemake(workdir, answers[dataset], "-n", "--configfile", str(changed))))
        if planned != reruns:
            wrong.append(f"{key} = {value!r}: planned {sorted(planned)}, expected {sorted(reruns)}")
    return wrong


def test_regenerate_reruns_exactly_for_the_settings_that_change_its_answers(answered_run, tmp_path):
    changes = {f"regenerate.{key}": (value, {"regenerate"} if reruns else set())
               for key, (value, reruns) in REGENERATE_CHANGES.items()}
    wrong = wrong_plans(answered_run, "synthetic", changes, tmp_path)
    assert not wrong, "\n".join(wrong)


# ----------------------------------------------------------------------------- self_prompts' settings

# a dataset of source self: key -> (new value, the rules that re-run). Settings that change a prompt the target writes
# re-run self_prompts (and regenerate, which answers the new file); regenerate's answer settings re-run regenerate
# only; chunks, batches and the other backend's keys re-run nothing (rules/common.smk: self_prompts_engine)
SELF_PROMPTS_CHANGES = {
    **{f"self_prompts.{k}": (v, {"self_prompts", "regenerate"}) for k, v in {
        "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 1, "max_new_tokens": 8, "min_words": 2,
        "max_words": 100, "max_benchmark_overlap": 0.8, "max_candidates_factor": 5}.items()},
    "datasets.mine.num_prompts": (3, {"self_prompts", "regenerate"}),
    **{f"regenerate.{k}": (v, {"self_prompts", "regenerate"}) for k, v in {
        "backend": "vllm", "dtype": "bfloat16", "device": "auto", "attention": "sdpa"}.items()},
    **{f"regenerate.{k}": (v, {"regenerate"}) for k, v in {
        "max_new_tokens": 3, "temperature": 0.7, "top_p": 0.5, "top_k": 5, "seed": 1, "samples_per_prompt": 2}.items()},
    **{f"regenerate.{k}": (v, set()) for k, v in {
        "chunk_size": 3, "batch_size": 1, "tensor_parallel_size": 2, "gpu_memory_utilization": 0.5,
        "max_model_len": 64}.items()},
}


def test_keeping_only_the_answers_that_end_reruns_prepare_alone(answered_run, tmp_path):
    """keep_cut_answers is prepare_dataset's filter: a regenerated dataset keeps its answers, and prepare, run on
    them, skips exactly the answers regenerate cut at max_new_tokens."""
    from conftest import copy_run

    wrong = wrong_plans(answered_run, "synthetic", {"datasets.synthetic.keep_cut_answers": (False, set())}, tmp_path)
    assert not wrong, "\n".join(wrong)
    workdir, answers = answered_run
    datasets = yaml.safe_load((workdir / "config.yaml").read_text())["datasets"]
    datasets["synthetic"]["keep_cut_answers"] = False
    copy = copy_run(workdir, tmp_path / "copy", {"datasets": datasets})
    rows = [json.loads(line) for line in Path(answers["synthetic"]).read_text().splitlines()]
    cut = sum(row["finish_reason"] == "length" for row in rows)
    stats_file = copy / "results" / "prepared" / "synthetic" / "stats.json"
    done = snakemake(copy, str(stats_file), check=False)
    assert set(jobs_planned(done)) == {"prepare_dataset"}  # the answers stay
    if cut < len(rows):  # some answers ended within the 2 new tokens: those are the samples
        stats = json.loads(stats_file.read_text())
        assert stats["skipped_by_reason"].get("cut_answer", 0) == cut and stats["records_read"] == len(rows)
    else:  # every answer cut: no usable record, and the error says why
        assert done.returncode != 0 and "cut_answer" in done.stdout + done.stderr


def test_self_prompts_rerun_exactly_for_the_settings_that_change_the_prompts(answered_run, tmp_path):
    wrong = wrong_plans(answered_run, "mine", SELF_PROMPTS_CHANGES, tmp_path)
    assert not wrong, "\n".join(wrong)
