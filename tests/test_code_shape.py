"""Code that reads well stays small: no class in the package over 300 lines, no function over 80
(issue 40). A part that grows past these is split by what it does, not by line count."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "agentcache"
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80


def _sizes() -> list[tuple[str, str, int]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found.append((f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}", kind,
                              node.end_lineno - node.lineno + 1))
    return found


def test_no_class_or_function_outgrows_its_limit():
    sizes = _sizes()
    assert len(sizes) > 500  # the walk saw the package
    too_long = [(where, lines) for where, kind, lines in sizes
                if lines > (MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES)]
    assert too_long == []
