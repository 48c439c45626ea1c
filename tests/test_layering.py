"""Imports run down the layers of docs/ARCHITECTURE.md ("Layers": its table is the data these tests read), never up or
across to another unit of the same layer, and no module imports itself back through others (every import counts,
those inside functions too)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"
PACKAGE = "draftsmith"


def read_layers(doc: Path = ARCHITECTURE) -> dict[str, int]:
    """unit -> layer from the table under the heading that starts with "## Layers": rows `| n | `unit`, ... | ... |`;
    a unit is a subpackage or module of draftsmith (or one module of a subpackage, written `package.module`)."""
    text = doc.read_text()
    section = re.search(r"^## Layers.*?$(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, f"{doc}: no section headed '## Layers'"
    layers = {}
    for row in re.finditer(r"^\|\s*(\d+)\s*\|([^|]*)\|", section.group(1), re.M):
        for unit in re.findall(r"`([\w.]+)`", row.group(2)):
            assert unit not in layers, f"{doc}: unit {unit!r} is in layers {layers[unit]} and {row.group(1)}"
            layers[unit] = int(row.group(1))
    assert layers, f"{doc}: the Layers section has no table rows `| n | `unit` ... |`"
    return layers


def package_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package under `root`."""
    modules = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported module of the package) for every import in the file, at any depth. `from a import b` names
    the module a.b where b is one, else a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                found.append((node.lineno, f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source))
    return sorted({(line, name) for line, name in found if name == PACKAGE or name.startswith(PACKAGE + ".")})


def unit_of(module: str, layers: dict[str, int]) -> str | None:
    """The most specific unit of the table holding `module` (None for the package root or a module in no unit)."""
    name = module.removeprefix(PACKAGE + ".")
    matches = [u for u in layers if name == u or name.startswith(u + ".")]
    return max(matches, key=len) if matches else None


def layering_problems(root: Path, layers: dict[str, int]) -> list[str]:
    """One line per module in no unit, and per import that goes up a layer or to another unit of its own layer."""
    modules = package_modules(root)
    problems = []
    for module, path in modules.items():
        unit = unit_of(module, layers)
        if module == PACKAGE:  # the package root sits under everything: it imports nothing of the package
            problems += [f"{path.relative_to(root)}:{line}: the package root imports {name}"
                         for line, name in imports_of(module, path, modules)]
            continue
        if unit is None:
            problems.append(f"{path.relative_to(root)}: {module} is in no unit of the layers table; add it")
            continue
        for line, name in imports_of(module, path, modules):
            target = unit_of(name, layers)
            if name == PACKAGE or target is None or target == unit:
                continue
            if layers[target] >= layers[unit]:
                how = "up" if layers[target] > layers[unit] else "across"
                problems.append(f"{path.relative_to(root)}:{line}: {module} ({unit}, layer {layers[unit]}) imports "
                                f"{name} ({target}, layer {layers[target]}): {how} a layer")
    return problems


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles of the module import graph (each once, as the modules in order back to the first)."""
    modules = package_modules(root)
    graph = {m: sorted({name for _, name in imports_of(m, p, modules) if name in modules and name != m})
             for m, p in modules.items()}
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in graph[module]:
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])
    return cycles


def test_every_import_runs_down_the_layers():
    layers = read_layers()
    problems = layering_problems(REPO, layers)
    assert not problems, "\n".join(problems)


def test_no_import_cycle():
    cycles = import_cycles(REPO)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_every_unit_of_the_table_exists():
    modules = package_modules(REPO)
    missing = [u for u in read_layers() if not any(m == f"{PACKAGE}.{u}" for m in modules)]
    assert not missing, f"{ARCHITECTURE}: the layers table names units the package does not have: {missing}"


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(("files", "expected"), [
    ({"low/a.py": "from draftsmith.high import b\n", "high/b.py": ""},
     ["draftsmith/low/a.py:1: draftsmith.low.a (low, layer 0) imports draftsmith.high.b (high, layer 1): up a layer"]),
    ({"high/b.py": "def f():\n    from draftsmith.peer import c\n", "peer/c.py": ""},
     ["draftsmith/high/b.py:2: draftsmith.high.b (high, layer 1) imports draftsmith.peer.c (peer, layer 1): across a "
      "layer"]),
    ({"high/__init__.py": "from . import b\n", "high/b.py": "from ..low import a\n", "low/a.py": ""}, []),
    ({"stray.py": ""}, ["draftsmith/stray.py: draftsmith.stray is in no unit of the layers table; add it"]),
])
def test_the_checker_reports_imports_up_or_across_a_layer(tmp_path, files, expected):
    """The checker on a made-up package (layers: low 0, high 1, peer 1): what it must report, relative imports and
    imports inside functions included."""
    write_package(tmp_path, {"__init__.py": "", "low/__init__.py": "", "peer/__init__.py": "", **files})
    doc = tmp_path / "ARCHITECTURE.md"
    doc.write_text("# A\n\n## Layers\n\n| layer | units |\n| ---: | --- |\n| 1 | `high`, `peer` |\n| 0 | `low` |\n\n"
                   "## Next\n\n| 5 | `ignored` |\n")
    assert read_layers(doc) == {"high": 1, "peer": 1, "low": 0}
    assert layering_problems(tmp_path, read_layers(doc)) == expected


def test_the_checker_finds_a_cycle_through_a_lazy_import(tmp_path):
    write_package(tmp_path, {"__init__.py": "", "a.py": "import draftsmith.b\n", "c.py": "from draftsmith import b\n",
                             "b.py": "def later():\n    from draftsmith import a\n"})
    assert import_cycles(tmp_path) == [["draftsmith.a", "draftsmith.b", "draftsmith.a"]]
