from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake, write_config
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from draftsmith.config.docs import render
from draftsmith.config.workflow import ConfigError, load_config, read_config_file

SCHEMA = str(REPO / "config" / "schema" / "config.schema.yaml")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_config_readme_is_generated_from_the_schema():
    assert (REPO / "config" / "README.md").read_text() == render(SCHEMA), "run: python -m draftsmith.config.docs > config/README.md"


def test_embedded_default_validates_on_its_own():
    validate(load(REPO / "config" / "config.yaml"), SCHEMA)


SHIPPED = [p for p in sorted((REPO / "config").glob("*.yaml")) if p.name != "config.yaml"]


@pytest.mark.parametrize("path", SHIPPED + sorted((REPO / "config" / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate_over_the_default(path):
    """Each shipped config as `--configfile` gives it: merged over the embedded default, then validated."""
    config = load_config([path])
    for name, variant in config["variants"].items():
        assert set(variant.get("datasets", [])) <= set(config["datasets"]), f"{path.name}: variants.{name}.datasets"


def test_the_scale_overlay_validates_on_top_of_its_base():
    config = load_config([REPO / "config" / "gpu-smollm2.yaml", REPO / "config" / "overlays" / "smollm2-50k.yaml"])
    written = config["datasets"]["written"]
    assert (written["source"], written["num_prompts"], written["regenerate"]) == ("self", 22000, True)
    assert set(config["datasets"]) == set(load(REPO / "config" / "gpu-smollm2.yaml")["datasets"])
    assert config["results"] == "results-smollm2-50k" and set(config["variants"]) == {"default", "data_20", "data_03"}


def test_the_longer_training_overlay_changes_only_the_training_schedule():
    base = [REPO / "config" / "gpu-smollm2.yaml", REPO / "config" / "overlays" / "smollm2-50k.yaml"]
    before, after = load_config(base), load_config([*base, REPO / "config" / "overlays" / "smollm2-50k-longer.yaml"])
    assert (after["training"]["epochs"], after["training"]["total_seq_length"]) == (4, 16384)
    # the same optimizer steps: twice the epochs over batches twice as large
    assert after["training"]["epochs"] / after["training"]["total_seq_length"] == \
        before["training"]["epochs"] / before["training"]["total_seq_length"]
    after["training"].update(epochs=before["training"]["epochs"], total_seq_length=before["training"]["total_seq_length"])
    assert after == before


def test_the_batch_sweep_overlay_validates_on_top_of_its_base():
    from draftsmith.config.batch_sizes import batch_size_problems, batch_sizes

    config = load_config([REPO / "config" / "gpu.yaml", REPO / "config" / "overlays" / "gpu-batch-sweep.yaml"])
    assert batch_sizes(config["benchmark"]) == [1, 4, 16, 64] and not batch_size_problems(config["benchmark"])


@pytest.mark.parametrize("change, message", [
    (lambda c: c["extraction"].update(num_shard=2), "num_shard"),
    (lambda c: c["extraction"].update(num_shards=0), "num_shards"),
    (lambda c: c["training"].update(epochs="three"), "epochs"),
    (lambda c: c["training"].update(total_seq_length=1000), "total_seq_length"),
    (lambda c: c["datasets"].update(extra={"source": "local"}), "path"),
    (lambda c: c["extraction"].update(aux_layer_ids=[1, 2]), "aux_layer_ids"),
    (lambda c: c["extraction"].update(aux_layer_ids=[2, 2, 5]), "non-unique"),
    (lambda c: c.update(colour="blue"), "colour"),
])
def test_bad_config_names_the_key(change, message):
    config = load(REPO / "config" / "config.yaml")
    change(config)
    with pytest.raises(WorkflowError) as e:
        validate(config, SCHEMA)
    assert message in str(e.value)


def test_bad_config_stops_the_workflow_at_start(tmp_path):
    write_config(tmp_path, {"extraction": {"num_shards": 0}})
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert "num_shards" in proc.stdout + proc.stderr and "minimum" in proc.stdout + proc.stderr


def with_duplicate_key(tmp_path: Path) -> tuple[Path, int]:
    """The tiny config with extraction.num_shards given twice, on consecutive lines; returns it and the first line's number."""
    path = write_config(tmp_path)
    lines = path.read_text().splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("num_shards:"))
    lines.insert(first + 1, "  num_shards: 3\n")
    path.write_text("".join(lines))
    return path, first + 1


def test_duplicate_key_stops_the_workflow_naming_file_key_and_line(tmp_path):
    path, first = with_duplicate_key(tmp_path)
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert f"{path}: line {first + 1}: key 'num_shards' is given twice (first on line {first})" in proc.stdout + proc.stderr


@pytest.mark.parametrize("command", ["validate", "preflight"])
def test_duplicate_key_stops_the_cli_naming_file_key_and_line(tmp_path, command, capsys):
    from draftsmith.cli import main

    path, first = with_duplicate_key(tmp_path)
    args = [command, str(tmp_path / "results"), "--config", str(path)] if command == "validate" else [command, "--config", str(path)]
    assert main(args) == 2
    assert f"{path}: line {first + 1}: key 'num_shards' is given twice (first on line {first})" in capsys.readouterr().err


def test_shipped_configs_have_no_duplicate_keys():
    from draftsmith.config.workflow import read_config_file

    for path in sorted(REPO.glob("config/**/*.yaml")):
        read_config_file(path)


def test_user_datasets_and_variants_replace_the_embedded_defaults(tmp_path):
    """Snakemake deep-merges --configfile over config/config.yaml: a config naming its own dataset would also
    prepare, extract and train on the synthetic corpus. Named sections are replaced instead, in both paths."""
    from draftsmith.config.workflow import load_config

    user = tmp_path / "mine.yaml"
    user.write_text("datasets:\n  chats: {source: local, path: chats.jsonl}\nvariants:\n  wide: {draft_layers: 2}\n")
    (tmp_path / "chats.jsonl").write_text("")
    config = load_config([user])
    filled = {"subset": None, "split": None, "revision": None, "max_records": None, "regenerate": False,
              "keep_cut_answers": True}
    assert config["datasets"] == {"chats": {"source": "local", "path": str(tmp_path / "chats.jsonl"), **filled}}
    assert config["variants"] == {"wide": {"draft_layers": 2}}
    assert load_config([])["datasets"] == {"synthetic": {"source": "synthetic", **filled, "regenerate": True},
                                           "fastchat": {"source": "fastchat", **filled, "regenerate": True}}
    write_config(tmp_path, {"datasets": {"chats": {"source": "local", "path": str(tmp_path / "chats.jsonl")}},
                            "variants": {"wide": {"draft_layers": 2}}})
    planned = snakemake(tmp_path, "-n", check=False).stdout
    assert "results/prepared/chats/" in planned and "results/prepared/synthetic/" not in planned
    assert "results/draft/wide/" in planned and "results/draft/default/" not in planned


def edited_config(tmp_path: Path, *edits: tuple[str, str], overrides: dict | None = None) -> Path:
    """The tiny config with lines replaced as written (spellings yaml.safe_dump would not produce: .inf, 2.0, 1e-3)."""
    path = write_config(tmp_path, overrides)
    text = path.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path.write_text(text)
    return path


def error_lines(proc) -> list[str]:
    """The lines of Snakemake's error report between `WorkflowError in file ...` and the `File ...` line."""
    lines = proc.stdout.splitlines()  # Snakemake prints it there (its profile notice goes to stderr)
    start = next(i for i, line in enumerate(lines) if line.startswith("WorkflowError"))
    return [line for line in lines[start + 1:] if not line.lstrip().startswith("File ")]


def user_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    return path


def test_non_finite_numbers_stop_the_workflow_naming_file_and_key(tmp_path):
    """NaN and Inf satisfy minimum/exclusiveMinimum: `lr: .inf` trained an all-NaN draft, exit 0."""
    path = edited_config(tmp_path, ("  lr: 0.002\n", "  lr: .inf\n"), ("  data_fraction: 1.0\n", "  data_fraction: .nan\n"),
                         ("  pretrain_lr: 0.003\n", "  pretrain_lr: -.inf\n"))
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert sorted(error_lines(proc)) == [f"{path}: embedded_target.pretrain_lr: -.inf is not a finite number",
                                         f"{path}: training.data_fraction: .nan is not a finite number",
                                         f"{path}: training.lr: .inf is not a finite number"]


@pytest.mark.parametrize("text, key, spelling", [
    ("training:\n  lr: .inf\n", "training.lr", ".inf"),
    ("training:\n  data_fraction: .nan\n", "training.data_fraction", ".nan"),
    ("training:\n  noise_std: .NaN\n", "training.noise_std", ".nan"),
    ("regenerate:\n  temperature: -.inf\n", "regenerate.temperature", "-.inf"),
    ("extraction:\n  aux_layer_ids: [1, .inf, 3]\n", "extraction.aux_layer_ids[1]", ".inf"),
    ("variants:\n  a: {lr: .inf}\n", "variants.a.lr", ".inf"),
])
def test_non_finite_numbers_are_rejected_by_load_config(tmp_path, text, key, spelling):
    path = user_config(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value) == f"{path}: {key}: {spelling} is not a finite number"


def test_integral_floats_are_integers_in_the_workflow(tmp_path):
    """`num_shards: 2.0` passed the schema (jsonschema's integer takes 2.0), then failed in range() naming no key."""
    edited_config(tmp_path, ("  num_shards: 2\n", "  num_shards: 2.0\n"), ("  epochs: 2\n", "  epochs: 2.0\n"),
                  ("seq_length: 256\n", "seq_length: 256.0\n"))
    planned = snakemake(tmp_path, "-n").stdout
    assert "results/shards/synthetic/shard_1/manifest.json" in planned


def test_integral_floats_become_ints_and_fractions_are_rejected(tmp_path):
    path = user_config(tmp_path, "seq_length: 256.0\nextraction: {num_shards: 2.0}\ntraining: {epochs: 3.0}\n"
                                 "variants:\n  a: {epochs: 1e1}\nbenchmark: {num_speculative_tokens: 4.0}\n")
    config = load_config([path])
    values = [config["seq_length"], config["extraction"]["num_shards"], config["training"]["epochs"],
              config["variants"]["a"]["epochs"], config["benchmark"]["num_speculative_tokens"]]
    assert values == [256, 2, 3, 10, 4] and all(type(v) is int for v in values)
    assert type(config["training"]["lr"]) is float  # a number key keeps its float
    path = user_config(tmp_path, "training: {epochs: 2.5}\n")
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value) == f"{path}: training.epochs: 2.5 is not an integer"


def test_exponent_numbers_are_numbers(tmp_path):
    """YAML 1.1 (PyYAML, Snakemake's loader) reads `1e-3` as a string: `lr: 1e-3` failed as not of type 'number'."""
    path = user_config(tmp_path, "a: 1e-3\nb: 1E5\nc: -2e-4\nd: 1.5e3\ne: '1e-3'\nf: 1_000\ng: 0.5\nh: 1e\n")
    assert read_config_file(path) == {"a": 0.001, "b": 100000.0, "c": -0.0002, "d": 1500.0, "e": "1e-3", "f": 1000,
                                      "g": 0.5, "h": "1e"}
    path = user_config(tmp_path, "training: {lr: 1e-3, noise_std: 5E-2}\n")
    assert load_config([path])["training"]["lr"] == 0.001
    path = user_config(tmp_path, "training: {lr: \"1e-3\"}\n")
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value) == f"{path}: training.lr: '1e-3' is not a number (a quoted number is a string: remove the quotes)"


def test_exponent_numbers_are_numbers_in_the_workflow(tmp_path):
    edited_config(tmp_path, ("  lr: 0.002\n", "  lr: 2e-3\n"), ("  pretrain_lr: 0.003\n", "  pretrain_lr: 3E-3\n"))
    assert "train_draft" in snakemake(tmp_path, "-n").stdout


@pytest.mark.parametrize("overrides, line", [
    ({"vocabs": {"draft_vocab_size": 256}}, "vocabs: unknown key; did you mean 'vocab'?"),
    ({"training": {"learning_rate": 0.001}}, "training.learning_rate: unknown key; did you mean 'lr'?"),
    ({"extraction": {"num_shard": 2}}, "extraction.num_shard: unknown key; did you mean 'num_shards'?"),
])
def test_unknown_key_is_one_line_with_the_nearest_valid_key(tmp_path, overrides, line):
    """A typo printed the whole schema (1,515 lines from `snakemake -n`), with no file and no suggestion."""
    path = write_config(tmp_path, overrides)
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert error_lines(proc) == [f"{path}: {line}"]
    assert len((proc.stdout + proc.stderr).splitlines()) < 10


@pytest.mark.parametrize("section", ["datasets", "variants", "training"])
def test_null_section_is_an_error_naming_the_key(tmp_path, section):
    """`datasets:` left empty failed in rules/common.smk with 'NoneType' object has no attribute 'items'."""
    path = user_config(tmp_path, f"{section}:\n")
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value) == f"{path}: {section}: is empty (null); expected a mapping"


def test_null_datasets_stops_the_workflow_naming_the_key(tmp_path):
    path = edited_config(tmp_path, ("datasets:\n  synthetic:\n    source: synthetic\n", "datasets:\n"))
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode != 0
    assert error_lines(proc) == [f"{path}: datasets: is empty (null); expected a mapping"]


def test_every_problem_is_one_line(tmp_path):
    path = user_config(tmp_path, "vocabs: {}\ntraining: {learning_rate: 1, epochs: 2.5, lr: .inf}\ndatasets:\n")
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value).splitlines() == [
        f"{path}: training.lr: .inf is not a finite number",
        f"{path}: vocabs: unknown key; did you mean 'vocab'?",
        f"{path}: datasets: is empty (null); expected a mapping",
        f"{path}: training.learning_rate: unknown key; did you mean 'lr'?",
        f"{path}: training.epochs: 2.5 is not an integer",
    ]


@pytest.mark.parametrize("command", ["validate", "preflight"])
def test_config_errors_stop_the_cli_with_one_line_each_and_exit_2(tmp_path, command, capsys):
    """`draftsmith preflight --config` printed 3,050 lines with a traceback for a typo."""
    from draftsmith.cli import main

    path = user_config(tmp_path, "vocabs: {draft_vocab_size: 256}\ntraining: {learning_rate: 0.001}\n")
    args = [command, str(tmp_path / "results"), "--config", str(path)] if command == "validate" else [command, "--config", str(path)]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert captured.err.splitlines() == [f"draftsmith {command}: {path}: vocabs: unknown key; did you mean 'vocab'?",
                                         f"{path}: training.learning_rate: unknown key; did you mean 'lr'?"]


@pytest.mark.parametrize("text, problem", [
    (None, "No such file or directory"),
    ("training: [1\nseed: 2\n", "line 2: expected ',' or ']', but got ':'"),
    ("- 1\n", "the config must be a mapping of keys, not list"),
])
def test_unreadable_config_file_is_one_line(tmp_path, text, problem):
    path = user_config(tmp_path, text) if text else tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value) == f"{path}: {problem}"


# ----------------------------------------------------------------------------- benchmark.batch_sizes

@pytest.mark.parametrize("text, lines", [
    ("benchmark: {backend: vllm, batch_sizes: [4, 1]}\n",
     ["benchmark.batch_sizes: [4, 1] must be ascending, e.g. [1, 4]"]),
    ("benchmark: {backend: vllm, batch_sizes: [1, 1]}\n", ["benchmark.batch_sizes: [1, 1] has non-unique elements"]),
    ("benchmark: {backend: vllm, batch_sizes: [0, 2]}\n", ["benchmark.batch_sizes[0]: 0 is less than the minimum of 1"]),
    ("benchmark: {backend: vllm, batch_sizes: []}\n", ["benchmark.batch_sizes: [] should be non-empty"]),
    ("benchmark: {backend: vllm, batch_sizes: 4}\n", ["benchmark.batch_sizes: 4 is not a list or null"]),
    ("benchmark: {batch_sizes: [4, 1]}\n", ["benchmark.batch_sizes: [4, 1] must be ascending, e.g. [1, 4]"]),
    ("benchmark: {batch_size: 2, batch_sizes: [1, 4]}\n",
     ["benchmark.batch_size: 2 beside benchmark.batch_sizes, which replaces it: leave batch_size out (or 1) and list "
      "the size in batch_sizes"]),
    ("benchmark: {backend: vllm, concurrency: 4, batch_sizes: [1, 4]}\n",
     ["benchmark.concurrency: 4 beside benchmark.batch_sizes, which replaces it: leave concurrency out (or 1) and list "
      "the size in batch_sizes"]),
])
def test_bad_batch_sizes_name_file_and_key(tmp_path, text, lines):
    path = user_config(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert str(e.value).splitlines() == [f"{path}: {line}" for line in lines]


def test_batch_sizes_stand_for_the_one_size_of_a_run_without_them(tmp_path):
    from draftsmith.config.batch_sizes import batch_sizes

    sweep = load_config([user_config(tmp_path, "benchmark: {backend: vllm, batch_sizes: [1, 4, 16], concurrency: 1}\n")])
    assert sweep["benchmark"]["batch_sizes"] == [1, 4, 16] and batch_sizes(sweep["benchmark"]) == [1, 4, 16]
    one = load_config([user_config(tmp_path, "benchmark: {backend: vllm, concurrency: 8}\n")])
    assert one["benchmark"]["batch_sizes"] is None and batch_sizes(one["benchmark"]) == [8]
    offline = load_config([user_config(tmp_path, "benchmark: {batch_sizes: [1]}\n")])["benchmark"]
    assert batch_sizes(offline) == [1] == batch_sizes({**offline, "batch_sizes": None})
    # the offline reference beside a vllm sweep: its one size is batch_size's, whatever the vllm backend sweeps
    assert batch_sizes({**sweep["benchmark"], "batch_sizes": None}, "offline") == [1]


def test_a_sweep_on_the_offline_backend_is_a_valid_workflow(tmp_path):
    offline = load_config([user_config(tmp_path, "benchmark: {batch_sizes: [1, 2]}\n")])["benchmark"]
    assert offline["backend"] == "offline" and offline["batch_sizes"] == [1, 2]
    write_config(tmp_path, {"benchmark": {"batch_sizes": [1, 2]}})
    proc = snakemake(tmp_path, "-n", check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_offline_benchmark_takes_a_sweep_and_refuses_nonsense_before_loading_anything():
    from draftsmith.benchmark.offline import check_settings
    from draftsmith.config.workflow import section_defaults

    cfg = {**section_defaults("benchmark"), "num_speculative_tokens": 3, "methods": ["target_greedy", "eagle3_draft"]}
    check_settings(cfg)
    check_settings({**cfg, "batch_sizes": [1]})
    check_settings({**cfg, "batch_sizes": [1, 4]})  # batched offline decoding (draftsmith.decoding.engine)
    check_settings({**cfg, "batch_size": 4})  # one size, 4
    for sizes in ([0, 2], [4, 1], [2, 2]):
        with pytest.raises(ValueError, match=r"benchmark.batch_sizes \(or batch_size\) = .*: sizes must be >= 1"):
            check_settings({**cfg, "batch_sizes": sizes})
