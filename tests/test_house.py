"""The house rules of issue 45 that a reader checks by eye, checked here: one formatter at one line length
(``ruff format``, the version pinned in pyproject.toml's test extra, settings in ``[tool.ruff]``), files split
by concept under 400 lines, functions of plait under 60 lines (docstring included), at most five top-level
modules in ``plait/``. Read from the source folders; fix a failure by formatting (``ruff format``) or by
splitting the named file or function, never by compacting lines."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _python_files() -> list[Path]:
    return sorted(
        p
        for d in ("plait", "tests", "benchmarks", "examples", "docs")
        for p in (ROOT / d).rglob("*.py")
    )


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    return [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and n.end_lineno - n.lineno + 1 > limit
    ]


def test_the_code_is_formatted_by_ruff():
    run = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, (
        f"run `ruff format` (pyproject.toml [tool.ruff]):\n{run.stdout}{run.stderr}"
    )


def test_no_file_over_400_lines():
    big = {
        str(p.relative_to(ROOT)): n
        for p in _python_files()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    }
    assert big == {}, f"split these by concept: {big}"


def test_no_function_of_plait_over_60_lines():
    long = {
        f"{p.relative_to(ROOT)}:{name}": n
        for p in _python_files()
        if p.parts[len(ROOT.parts)] == "plait"
        for name, n in long_functions(p.read_text(encoding="utf-8"))
    }
    assert long == {}, f"split these functions: {long}"


def test_the_function_check_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"def f():\n{body[: body.rindex(chr(10))]}\n") == []


def test_at_most_five_top_level_modules():
    top = sorted(p.name for p in (ROOT / "plait").glob("*.py"))
    assert len(top) <= 5, top
