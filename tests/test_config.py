from contextlib import nullcontext
from pathlib import Path

import pytest
import yaml
from conftest import REPO, snakemake, write_config
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from draftsmith.config.docs import render
from draftsmith.config.workflow import load_config

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
    with pytest.raises(SystemExit) if command == "preflight" else nullcontext():
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
    config = load_config([user])
    filled = {"subset": None, "split": None, "revision": None, "max_records": None, "regenerate": False}
    assert config["datasets"] == {"chats": {"source": "local", "path": "chats.jsonl", **filled}}
    assert config["variants"] == {"wide": {"draft_layers": 2}}
    assert load_config([])["datasets"] == {"synthetic": {"source": "synthetic", **filled, "regenerate": True},
                                           "fastchat": {"source": "fastchat", **filled, "regenerate": True}}
    (tmp_path / "chats.jsonl").write_text("")
    write_config(tmp_path, {"datasets": {"chats": {"source": "local", "path": str(tmp_path / "chats.jsonl")}},
                            "variants": {"wide": {"draft_layers": 2}}})
    planned = snakemake(tmp_path, "-n", check=False).stdout
    assert "results/prepared/chats/" in planned and "results/prepared/synthetic/" not in planned
    assert "results/draft/wide/" in planned and "results/draft/default/" not in planned
