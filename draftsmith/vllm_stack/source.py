"""Reading the installed vLLM, speculators and transformers as source, without importing them.

Importing vLLM takes tens of seconds and needs its compiled extension, while preflight must answer
in seconds on any machine: so signatures, class fields, registries and call sites are read with `ast`.
tests/contract/ checks that the parsed signatures equal the real ones.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@functools.lru_cache(maxsize=None)
def package_dir(package: str) -> Path | None:
    """Where a top-level package is installed, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def module_path(module: str) -> Path | None:
    top, _, rest = module.partition(".")
    root = package_dir(top)
    if root is None:
        return None
    base = root.joinpath(*rest.split(".")) if rest else root
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def parse_module(module: str) -> ast.Module | None:
    path = module_path(module)
    return ast.parse(path.read_text(), filename=str(path)) if path else None


def find_def(module: str, qualname: str) -> ast.ClassDef | ast.FunctionDef | None:
    """The class or function `qualname` ("Class", "Class.method", "function") defined in `module`."""
    node: ast.AST | None = parse_module(module)
    for part in qualname.split("."):
        if node is None:
            return None
        body = getattr(node, "body", [])
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
    return node  # type: ignore[return-value]


@dataclass(frozen=True)
class Params:
    """The parameters a callable takes: name -> required, and whether it accepts **kwargs."""

    where: str
    required: dict[str, bool]
    var_keyword: bool = False

    def bind(self, names: list[str]) -> list[str]:
        """Problems with calling it with these keyword arguments (empty when the call binds)."""
        problems = [f"missing required argument {n!r}" for n, req in self.required.items() if req and n not in names]
        if not self.var_keyword:
            problems += [f"unexpected keyword argument {n!r}" for n in names if n not in self.required]
        return problems


def _function_params(fn: ast.FunctionDef, where: str, drop_self: bool) -> Params:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    required = {arg.arg: d is None for arg, d in zip(positional, defaults)}
    required.update({arg.arg: d is None for arg, d in zip(a.kwonlyargs, a.kw_defaults)})
    if drop_self and positional:
        required.pop(positional[0].arg)
    return Params(where, required, a.kwarg is not None)


def _is_classvar(annotation: ast.expr) -> bool:
    return "ClassVar" in ast.unparse(annotation)


def _field_init(value: ast.expr | None) -> tuple[bool, bool]:
    """(in __init__, required) for a dataclass-style field's assigned value."""
    if value is None:
        return True, True
    if isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] in ("field", "Field"):
        for kw in value.keywords:
            if kw.arg == "init" and isinstance(kw.value, ast.Constant) and kw.value.value is False:
                return False, False
        has_default = any(kw.arg in ("default", "default_factory") for kw in value.keywords) or bool(value.args)
        return True, not has_default
    return True, False


def params(module: str, qualname: str) -> Params | None:
    """Parameters of a function, a method, or a class's constructor (its __init__, or its
    dataclass-style annotated fields); None when the installed code has no such name."""
    node = find_def(module, qualname)
    where = f"{module}.{qualname}"
    if node is None:
        return None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _function_params(node, where, drop_self="." in qualname)
    init = find_def(module, f"{qualname}.__init__")
    if init is not None:
        return _function_params(init, where, drop_self=True)
    required = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not _is_classvar(stmt.annotation):
            in_init, req = _field_init(stmt.value)
            if in_init:
                required[stmt.target.id] = req
    return Params(where, required)


def field_default(module: str, qualname: str, field: str):
    """The literal default of a dataclass-style field (ast node when not a literal); KeyError if absent."""
    node = find_def(module, qualname)
    for stmt in getattr(node, "body", []):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == field:
            try:
                return ast.literal_eval(stmt.value) if stmt.value is not None else None
            except ValueError:
                return stmt.value
    raise KeyError(f"{module}.{qualname} has no field {field!r}")


def has_method(module: str, cls: str, method: str) -> bool:
    return find_def(module, f"{cls}.{method}") is not None


def calls_in(module: str, qualname: str) -> list[ast.Call]:
    node = find_def(module, qualname)
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)] if node is not None else []


def source_of(module: str, qualname: str) -> str:
    node = find_def(module, qualname)
    return ast.unparse(node) if node is not None else ""


@functools.lru_cache(maxsize=None)
def registry_archs(table: str) -> tuple[str, ...]:
    """Architecture names in one of vLLM's model-registry tables (e.g. _TEXT_GENERATION_MODELS)."""
    tree = parse_module("vllm.model_executor.models.registry")
    for node in getattr(tree, "body", []):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == table for t in targets) and isinstance(node.value, ast.Dict):
            return tuple(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return ()


# vLLM 0.16.0's list (config/speculative.py), for machines without vLLM installed
EAGLE3_TARGETS_VLLM_0_16 = ["llama", "qwen", "minicpm", "gpt_oss", "hunyuan_vl", "hunyuan_v1_dense", "afmoe"]


def eagle3_target_model_types() -> list[str] | None:
    """The target model types the installed vLLM's SpeculativeConfig accepts for method eagle3 (substring
    match on the text config's model_type); None when vLLM is not installed."""
    tree = parse_module("vllm.config.speculative")
    for node in ast.walk(tree) if tree else []:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "eagle3_target_supported"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None
