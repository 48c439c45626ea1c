"""Lines of code of a set of Python files, as the engine's line goal counts them: lines holding code, not blank, not
comments alone, not docstrings (a module's, class's or function's first string).

    python -m perf code_lines draftsmith/decoding          # per file and in all
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

from perf.common import parser

NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """The lines of `source` that hold a token of code outside its docstrings."""
    docstrings = docstring_lines(ast.parse(source))
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in NOT_CODE:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def main(argv: list[str]) -> None:
    args = parser(__doc__)
    args.add_argument("paths", nargs="+", help="files, or folders whose *.py files count")
    opts = args.parse_args(argv)
    files = [f for p in map(Path, opts.paths) for f in (sorted(p.glob("*.py")) if p.is_dir() else [p])]
    counts = {str(f): code_lines(f.read_text()) for f in files}
    width = max(map(len, counts))
    for name, n in counts.items():
        print(f"{name:<{width}}  {n:>5}")
    print(f"{'total':<{width}}  {sum(counts.values()):>5}")
