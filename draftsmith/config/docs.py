"""Render config/README.md from the JSON schema, so the documentation cannot drift from validation."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

HEADER = """# Configuration

`config/config.yaml` is the embedded default; `config/examples/` has real runs. Every key is
validated against `config/schema/config.schema.yaml` when the workflow starts; an unknown key, a
wrong type or an empty (null) section stops the run with one line per problem naming the file and the
key path (`mine.yaml: training.learning_rate: unknown key; did you mean 'lr'?`). Numbers: NaN and
Inf (`.nan`, `.inf`) are rejected anywhere; `2.0` where an integer is meant is read as `2`, while `2.5`
is an error; `1e-3`, `1E5`, `-2e-4` are numbers (YAML 1.1 would read them as strings), but a quoted
`"1e-3"` is a string, which a number key rejects. This page is generated from that
schema (`python -m draftsmith.config.docs > config/README.md`); a test keeps it current. The schema
is the only place defaults live: validation fills them in, for the workflow and the `draftsmith` CLI alike.
Several files (`--configfile a.yaml b.yaml`) layer as README.md's "Layering configs" says: scalars and lists
replace, sections merge key by key, and a later file's `datasets` or `variants` replaces the whole map; a relative
path resolves against the folder of the file that sets it.

| key | type | default | description |
| --- | --- | --- | --- |
"""


def _type(node: dict) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    if "oneOf" in node:
        return " or ".join(_type(n) if "$ref" not in n else "dataset" for n in node["oneOf"])
    t = node.get("type", "object" if "properties" in node else "")
    return " or ".join(t) if isinstance(t, list) else t


def _rows(node: dict, prefix: str, definitions: dict):
    if "$ref" in node:
        node = definitions[node["$ref"].split("/")[-1]]
    for key, child in node.get("properties", {}).items():
        name = f"{prefix}{key}"
        default = f"`{json.dumps(child['default'])}`" if "default" in child and child["default"] != {} else ""
        yield f"| `{name}` | {_type(child)} | {default} | {child.get('description', '')} |"
        yield from _rows(child, f"{name}.", definitions)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        yield from _rows(extra, f"{prefix}<name>.", definitions)


def render(schema_path: str | Path) -> str:
    schema = yaml.safe_load(Path(schema_path).read_text())
    return HEADER + "\n".join(_rows(schema, "", schema.get("definitions", {}))) + "\n"


if __name__ == "__main__":
    print(render(Path(__file__).resolve().parents[2] / "config" / "schema" / "config.schema.yaml"), end="")
