"""The house rule on size, checked on the source: no function or method of slurm_hai/ is over
MAX_LINES lines (from its `def` line, decorators not counted, to its last line, docstring
and comments included). A longer one is split into functions with names that say what
each part does."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slurm_hai"
MAX_LINES = 80


def sizes_in(source: str, path: str) -> dict[str, int]:
    """`path:qualified.name` -> lines, of every function and method in `source`, nested ones too."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    assert child.end_lineno is not None
                    sizes[f"{path}:{name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, path), "")
    return sizes


def function_sizes() -> dict[str, int]:
    """sizes_in of every module of the package, its path relative to slurm_hai/."""
    sizes: dict[str, int] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" not in file.parts:
            sizes.update(sizes_in(file.read_text(), file.relative_to(PACKAGE).as_posix()))
    return sizes


def test_no_function_is_over_80_lines():
    sizes = function_sizes()
    too_long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_long, "over {} lines (split them): {}".format(
        MAX_LINES, ", ".join(f"slurm_hai/{name} ({n} lines)" for name, n in sorted(too_long.items())))


def test_each_function_is_counted_on_its_own_from_its_def_to_its_last_line():
    source = ("def outer():\n    def inner():\n        return 1\n\n    return inner\n\n\n"
              "class C:\n    @staticmethod\n    def method():\n        if True:\n            pass\n"
              "    async def later(self):\n        pass\n")
    assert sizes_in(source, "m.py") == {"m.py:outer": 5, "m.py:outer.inner": 2, "m.py:C.method": 3,
                                        "m.py:C.later": 2}
