"""Preflight: one line per check, a failure per problem, in seconds, with no weights (nor torch) loaded."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import REPO, SNAKEMAKE, TINY_CONFIG, jobs_planned, snakemake

from draftsmith.config.workflow import validate
from draftsmith.vllm_stack import compat, source
from draftsmith.cli import main as cli_main
from draftsmith.preflight import run_preflight

CONFIG = {**copy.deepcopy(TINY_CONFIG), "target": {"model": "embedded", "revision": None, "trust_remote_code": False},
          "datasets": {"synthetic": {"source": "synthetic"}}, "variants": {"default": {}}}

# Kimi-K2.5's config.json in outline: a multimodal wrapper around a DeepSeek-V3 text model, with remote code.
KIMI_LIKE = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
    "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
    "text_config": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
                    "num_hidden_layers": 61, "vocab_size": 163840},
}



def main(argv: list[str]) -> int:
    """`draftsmith preflight <argv>`."""
    return cli_main(["preflight", *argv])

@pytest.fixture
def llama(tmp_path) -> Path:
    """A target directory with only a config.json, shaped like the tiny embedded target: preflight reads nothing else."""
    path = tmp_path / "llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024}))
    return path


def config(**sections) -> dict:
    """A workflow config as preflight gets it: validated, every default filled in."""
    cfg = copy.deepcopy(CONFIG)
    for key, value in sections.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    return validate(cfg)


def vllm_config(**sections) -> dict:
    return config(extraction={"backend": "vllm", "tensor_parallel_size": 1, **sections.pop("extraction", {})},
                  benchmark={"backend": "vllm", **sections.pop("benchmark", {})}, **sections)


def failing(report) -> list[str]:
    return [c.name for c in report.checks if c.status == "fail"]


def test_embedded_default_passes_with_one_line_per_check(llama):
    report = run_preflight(config(), str(llama), tokens=20000, gpus=0)
    assert report.ok, report.problems
    lines = report.lines()
    assert len(lines) == len(report.checks) and all("\n" not in line for line in lines)
    names = [c.name for c in report.checks]
    for name in ("version transformers", "target architecture (hf)", "layer ids", "draft vocab", "disk", "gpus (extraction)"):
        assert name in names
    disk = next(c for c in report.checks if c.name == "disk")
    assert "20000 tokens x 4 layers x 64 hidden x 4 bytes" in disk.message  # float32 on the CPU


def test_preflight_is_fast_and_loads_no_weights(llama):
    code = textwrap.dedent(f"""
        import sys, time
        start = time.perf_counter()
        from draftsmith.preflight import run_preflight
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from test_preflight import vllm_config
        report = run_preflight(vllm_config(), {str(llama)!r}, tokens=1000, gpus=1)
        print(round(time.perf_counter() - start, 2), "torch" in sys.modules, "vllm" in sys.modules, len(report.checks))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    seconds, torch_loaded, vllm_loaded = float(out[0]), out[1], out[2]
    assert seconds < 10 and torch_loaded == "False" and vllm_loaded == "False"


def test_problems_each_give_one_failing_check(llama, tmp_path):
    cfg = config(extraction={"aux_layer_ids": [1, 3, 9], "device": "cuda"}, vocab={"draft_vocab_size": 4096})
    report = run_preflight(cfg, str(llama), tokens=100, gpus=0)
    assert failing(report) == ["layer ids", "draft vocab", "gpus (extraction)"]
    assert "[9] are outside the target's decoder layers 0..5" in report.problems[0]
    assert "4096 exceeds the target's vocabulary of 512" in report.problems[1]
    big = run_preflight(config(results=str(tmp_path)), str(llama), tokens=10**15, gpus=0)
    assert failing(big) == ["disk"]


def test_seq_length_beyond_the_targets_positions_fails(llama):
    report = run_preflight(config(seq_length=2048), str(llama), tokens=100, gpus=0)
    assert failing(report) == ["seq length"]
    assert "seq_length=2048 exceeds the target's max_position_embeddings=1024" in report.problems[0]
    assert "set seq_length to at most 1024" in report.problems[0]
    assert run_preflight(config(seq_length=1024), str(llama), tokens=100, gpus=0).ok


@pytest.mark.parametrize("aux", [[2, 2, 5], None], ids=["configured", "default_for_6_layers"])
def test_repeated_aux_layer_ids_fail(llama, aux):
    cfg = config()
    cfg["extraction"]["aux_layer_ids"] = aux  # after validation: the schema refuses a configured repeat first
    report = run_preflight(cfg, str(llama), tokens=100, gpus=0)
    assert failing(report) == ["layer ids"]
    assert "repeat a layer; set extraction.aux_layer_ids to three different layers of 0..5" in report.problems[0]
    assert ("[2, 2, 5] (extraction.aux_layer_ids)" if aux else "[2, 3, 3] (vLLM's default [2, L//2, L-3] for L=6)") \
        in report.problems[0]


def test_more_shards_than_samples_fails_naming_the_dataset(llama, tmp_path):
    cfg = config(results=str(tmp_path), extraction={"num_shards": 8}, datasets={"big": {"source": "synthetic"}, "small": {"source": "synthetic"}})
    report = run_preflight(cfg, str(llama), tokens=100, gpus=0, samples={"big": 100, "small": 5})
    assert failing(report) == ["shard count"]
    assert report.problems[0] == (f"shard count: dataset 'small' has 5 samples (records_kept in {tmp_path}/prepared/small/"
                                  "stats.json) but extraction.num_shards=8, so 3 shard(s) would be empty; "
                                  "set extraction.num_shards to at most 5")
    assert run_preflight(cfg, str(llama), tokens=100, gpus=0, samples={"big": 100, "small": 8}).ok


def test_missing_target_and_remote_code_opt_in(tmp_path):
    report = run_preflight(config(), str(tmp_path / "nowhere"), gpus=0)
    assert failing(report) == ["target config"] and "config.json" in report.problems[0]
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(KIMI_LIKE))
    report = run_preflight(config(vocab={"draft_vocab_size": 32000}), str(tmp_path / "kimi"), tokens=10, gpus=0)
    assert "target trust_remote_code" in failing(report)


def test_kimi_k2_5_needs_a_newer_vllm_for_the_vllm_benchmark(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LIKE))
    trusted = {"model": "moonshotai/Kimi-K2.5", "trust_remote_code": True}
    offline = run_preflight(config(target=trusted, vocab={"draft_vocab_size": 32000}, extraction={"aux_layer_ids": [2, 30, 58]}),
                            str(tmp_path), tokens=10, gpus=0)
    serving = next(c for c in offline.checks if c.name == "eagle3 serving")
    assert serving.status == "warn" and "'deepseek_v3'" in serving.message
    assert "needs a newer vLLM" in serving.message and "offline benchmark still works" in serving.message
    online = run_preflight(config(target=trusted, vocab={"draft_vocab_size": 32000}, benchmark={"backend": "vllm"},
                                  extraction={"aux_layer_ids": [2, 30, 58]}), str(tmp_path), tokens=10, gpus=8)
    assert "eagle3 serving" in failing(online)


def test_vllm_backends_check_gpus_and_layer_zero(llama):
    report = run_preflight(vllm_config(extraction={"tensor_parallel_size": 2, "aux_layer_ids": [0, 2, 3]}),
                           str(llama), tokens=10, gpus=1)
    assert {"gpus (extraction)", "layer ids (vllm)"} <= set(failing(report))
    assert "extraction.tensor_parallel_size=2 but 1 GPU(s) are visible" in " ".join(report.problems)


needs_vllm = pytest.mark.skipif(source.package_dir("vllm") is None,
                                reason="vLLM is not installed here; the fix probes read its source")


def fix_problems(report) -> list[str]:
    return [p for p in report.problems if p.startswith(("fix ", "call "))]


@needs_vllm
def test_patched_stack_passes(llama):
    report = run_preflight(vllm_config(), str(llama), tokens=10, gpus=1)
    assert fix_problems(report) == []
    assert any(c.name == "call sites" and c.status == "ok" for c in report.checks)
    assert len(report.fixes) == len(compat.FIXES) and all(f["applied"] for f in report.fixes)


@needs_vllm
@pytest.mark.parametrize("fix", compat.FIX_NAMES)
def test_each_incompatibility_is_found_when_its_fix_is_off(llama, fix):
    report = run_preflight(vllm_config(), str(llama), tokens=10, gpus=1, disabled_fixes=[fix])
    problems = fix_problems(report)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"fix {fix}:") or f"(fix {fix} is off)" in problems[0]


def test_cli_prints_a_line_per_check_and_exits_nonzero_on_problems(llama, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config(vocab={"draft_vocab_size": 4096}, results=str(tmp_path))))
    assert main(["--config", str(path), "--target", str(llama), "--json", str(tmp_path / "p.json")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "preflight: 1 problem(s)" and any(line.startswith("[FAIL] draft vocab:") for line in out)
    assert json.loads((tmp_path / "p.json").read_text())["problems"][0].startswith("draft vocab:")


def test_cli_checks_the_shard_count_against_the_prepared_stats(llama, tmp_path, capsys):
    stats = tmp_path / "prepared" / "synthetic" / "stats.json"
    stats.parent.mkdir(parents=True)
    stats.write_text(json.dumps({"records_kept": 1, "tokens": 40}))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config(results=str(tmp_path))))
    assert main(["--config", str(path), "--target", str(llama)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"[FAIL] shard count: dataset 'synthetic' has 1 samples (records_kept in {stats}) but extraction.num_shards=2, " \
        "so 1 shard(s) would be empty; set extraction.num_shards to at most 1" in out


SNAKEFILE = """
configfile: "{config}"
include: "{repo}/rules/common.smk"
include: "{repo}/rules/data.smk"
include: "{repo}/rules/preflight.smk"
include: "{repo}/rules/extract.smk"
"""


def snakemake_preflight(tiny_target, tmp_path, *targets, **sections) -> subprocess.CompletedProcess:
    """`snakemake preflight` (or `targets`) with the repo's rules on a local dataset of 20 chats for `tiny_target`."""
    from draftsmith.data.synthetic import generate_corpus
    from draftsmith.io import write_jsonl

    train, _ = generate_corpus(20, 1, seed=5)
    write_jsonl(tmp_path / "chats.jsonl", train)
    cfg = config(results=str(tmp_path / "results"), **sections)
    cfg["target"] = {"model": str(tiny_target), "revision": None, "trust_remote_code": False}
    cfg["datasets"] = {"chats": {"source": "local", "path": str(tmp_path / "chats.jsonl")}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "Snakefile").write_text(SNAKEFILE.format(config=tmp_path / "config.yaml", repo=REPO))
    # this checkout's package, also where the installed one is another checkout's (the Snakefile here is not the repo's)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([SNAKEMAKE, "-s", str(tmp_path / "Snakefile"), "--directory", str(tmp_path), "--cores", "2",
                           *(targets or ["preflight"])], capture_output=True, text=True, env=env)


def test_snakemake_preflight_rule(tiny_target, tmp_path):
    """`snakemake preflight` with the repo's rules on a local dataset: on a fresh tree it plans no other job (it
    once prepared every dataset and built the target first) and prints every check and the verdict on the console;
    once the dataset is prepared it also predicts the shards' disk use."""
    proc = snakemake_preflight(tiny_target, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert jobs_planned(proc) == {"preflight": 1}
    assert "[  ok] layer ids" in proc.stdout and "[warn] disk: token count unknown until the datasets are prepared" \
        in proc.stdout
    assert "preflight: ok (log: results/logs/preflight.log)" in proc.stdout  # the tree lies under the working directory
    snakemake_preflight(tiny_target, tmp_path, "results/prepared/chats/stats.json")  # as Snakemake spells the tree
    proc = snakemake_preflight(tiny_target, tmp_path)
    assert proc.returncode == 0 and "[  ok] disk: shards need about" in proc.stdout, proc.stderr[-3000:]


def test_snakemake_preflight_rule_refuses_more_shards_than_samples(tiny_target, tmp_path):
    """The rule reads the prepared stats.json where it exists: 25 shards of 20 samples fail in preflight; a plain run fails in the
    extraction job's own preflight, before it loads the target."""
    stats = "results/prepared/chats/stats.json"  # the tree lies under the working directory: Snakemake's spelling
    snakemake_preflight(tiny_target, tmp_path, stats, extraction={"num_shards": 25})
    proc = snakemake_preflight(tiny_target, tmp_path, extraction={"num_shards": 25})
    assert proc.returncode != 0
    kept = json.loads((tmp_path / stats).read_text())["records_kept"]
    assert kept == 20
    problem = (f"shard count: dataset 'chats' has 20 samples (records_kept in {stats}) but extraction.num_shards=25, "
               "so 5 shard(s) would be empty; set extraction.num_shards to at most 20")
    assert f"[FAIL] {problem}" in proc.stdout and "preflight: 1 problem(s)" in proc.stdout
    manifest = "results/shards/chats/shard_0/manifest.json"
    proc = snakemake_preflight(tiny_target, tmp_path, manifest, extraction={"num_shards": 25})
    assert proc.returncode != 0 and not (tmp_path / manifest).exists()
    log = tmp_path / "results" / "logs" / "extract_hidden_states" / "chats" / "shard_0.log"
    text = log.read_text()
    assert f"preflight (extract) found problems:\n{problem}" in text
    assert "extracting shard" not in text  # stopped before the driver loaded the target


def test_a_gpu_count_this_machine_cannot_give_stops_the_run_before_any_job(tmp_path):
    """training.gpus: 4 where no GPU is visible: the run stops before its first job, naming the key (train_draft once
    failed an hour later, after extraction, with torch's 'Cannot access accelerator device')."""
    from conftest import write_config

    write_config(tmp_path, {"training": {"gpus": 4}})
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0
    assert "gpus (training): training.gpus=4 but 0 GPU(s) are visible" in proc.stdout + proc.stderr
    assert not [p for p in (tmp_path / "results").rglob("*") if p.is_file() and p.name != ".draftsmith.lock"]


def test_fresh_clone_checks_the_target_the_workflow_builds_once_it_is_built(llama, tmp_path, capsys):
    """`draftsmith preflight` on a fresh clone once read the packaged target's name as a hub id and failed after 23 s
    of hub retries: a target rule import_target (or build_target) makes is checked once built, and preflight says so."""
    import time

    path = tmp_path / "mine.yaml"
    path.write_text(f"results: {tmp_path / 'results'}\n")
    start = time.perf_counter()
    assert main(["--config", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert time.perf_counter() - start < 10
    assert "[  ok] target: built by rule import_target; checked after it is built" in out and out[-1] == "preflight: ok"
    built = tmp_path / "results" / "target"
    built.mkdir(parents=True)
    (built / "config.json").write_text((llama / "config.json").read_text())
    assert main(["--config", str(path)]) == 1  # the built target's 512 tokens are fewer than the default's draft vocab
    out = capsys.readouterr().out
    assert "[FAIL] draft vocab: vocab.draft_vocab_size=1024 exceeds the target's vocabulary of 512" in out
    assert "[  ok] seq length:" in out and "built by rule" not in out


def test_a_hub_target_is_read_from_the_cache_only(tmp_path, capsys):
    """No download and no retries: a hub id not in the cache fails in seconds, saying how to fetch its config.json."""
    import time

    path = tmp_path / "mine.yaml"
    path.write_text(f"results: {tmp_path / 'results'}\n")
    start = time.perf_counter()
    assert main(["--config", str(path), "--target", "nobody-here/no-such-model"]) == 1
    assert time.perf_counter() - start < 10
    out = capsys.readouterr().out
    assert "[FAIL] target config: cannot read config.json of nobody-here/no-such-model" in out
    assert "`hf download nobody-here/no-such-model config.json` fetches the file" in out


def test_help_names_the_command_and_folds_the_fix_names_into_one_option(llama, capsys):

    with pytest.raises(SystemExit):
        cli_main(["preflight", "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: draftsmith preflight ") and text.count("--disable-fix") == 2  # usage and option
    assert all(name in text for name in compat.FIX_NAMES) and "{" not in text
    first, second = compat.FIX_NAMES[:2]
    assert main(["--target", str(llama), "--disable-fix", f"{first},{second}"]) in (0, 1)
    with pytest.raises(SystemExit):
        main(["--disable-fix", "no_such_fix"])
    assert "unknown fix no_such_fix; one of:" in capsys.readouterr().err
