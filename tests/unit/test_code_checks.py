"""The code is checked as well as run: lint, formatting, types, and the size limits that keep
the launch package readable (docs/architecture.md)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import trainflow

ROOT = Path(trainflow.__file__).parent.parent
LINTED = ["trainflow", "flows", "tasks", "tests", "benchmarks", "deployments"]

# The launch package, kept small enough to read: lines of code per module, class and function
# (a docstring is documentation, not code, and is not counted).
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 60


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=900
    )


def test_ruff_finds_nothing():
    out = _run("ruff", "check", *LINTED)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_code_is_formatted():
    out = _run("ruff", "format", "--check", *LINTED)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_mypy_finds_nothing():
    # What pyproject's `[tool.mypy] files` names: the library and the Prefect layer on it.
    out = _run("mypy")
    assert out.returncode == 0, out.stdout + out.stderr


def _docstring_lines(node: ast.AST) -> int:
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
        doc = body[0]
        if isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
            return doc.end_lineno - doc.lineno + 1  # type: ignore[operator]
    return 0


def oversized(path: Path) -> list[str]:
    """What in `path` is over the size limits, counted without docstrings."""
    tree = ast.parse(path.read_text())
    found = []
    docs = sum(_docstring_lines(n) for n in ast.walk(tree))
    lines = len(path.read_text().splitlines()) - docs
    if lines > MAX_MODULE_LINES:
        found.append(f"{path.name}: {lines} lines")
    for node in ast.walk(tree):
        limit = {ast.ClassDef: MAX_CLASS_LINES, ast.FunctionDef: MAX_FUNCTION_LINES}.get(type(node))
        if limit is None:
            continue
        inner = sum(_docstring_lines(n) for n in ast.walk(node))
        size = node.end_lineno - node.lineno + 1 - inner  # type: ignore[attr-defined]
        if size > limit:
            found.append(f"{path.name}:{node.name}: {size} lines")  # type: ignore[attr-defined]
    return found


def test_launch_modules_classes_and_functions_stay_small():
    found = [o for p in sorted((ROOT / "trainflow" / "launch").glob("*.py")) for o in oversized(p)]
    assert found == []


def test_the_size_check_counts_code(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "big.py").write_text(f'def big():\n    """Doc."""\n{body}\n')
    assert oversized(tmp_path / "big.py") == [f"big.py:big: {MAX_FUNCTION_LINES + 1} lines"]
    short = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 2))
    doc = '    """' + "\n" * 30 + '    """'
    (tmp_path / "ok.py").write_text(f"def ok():\n{doc}\n{short}\n")
    assert oversized(tmp_path / "ok.py") == []
