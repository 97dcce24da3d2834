"""The frontend's code, read from the source (no import runs): no function longer than
MAX_FUNCTION_LINES, and no comment or docstring that tells benchmark history (that belongs to
commit messages; comments state invariants and reasons)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

FRONTEND = Path(__file__).resolve().parents[2] / "worker" / "frontend"
MAX_FUNCTION_LINES = 80

# "P8", "P11 run", "fourth run", "bench/RESULTS.md": where a number came from, not why.
HISTORY = re.compile(
    r"\bP\d+\b|RESULTS\.md|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth)"
    r" run\b",
    re.IGNORECASE,
)


def _sources() -> list[Path]:
    paths = sorted(FRONTEND.rglob("*.py"))
    assert len(paths) > 10  # the package was found
    return paths


def function_lengths(source: str) -> dict[str, int]:
    """Each function's (nested ones and methods too) lines, from its `def` to its last line."""
    lengths: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            lengths[f"{node.name}:{node.lineno}"] = node.end_lineno - node.lineno + 1
    return lengths


def _prose(source: str) -> list[str]:
    """The source's comments and docstrings."""
    texts = [
        tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            texts.append(ast.get_docstring(node) or "")
    return texts


def test_no_function_in_the_frontend_is_longer_than_80_lines() -> None:
    too_long = {
        f"{path.relative_to(FRONTEND)}:{name}": lines
        for path in _sources()
        for name, lines in function_lengths(path.read_text()).items()
        if lines > MAX_FUNCTION_LINES
    }
    assert too_long == {}


def test_the_length_check_counts_from_def_to_the_last_line() -> None:
    source = (
        "@decorator\ndef f():\n    x = 1\n\n    return x\n\n\n"
        "class C:\n    async def g(self):\n        pass\n"
    )
    assert function_lengths(source) == {"f:2": 4, "g:9": 2}
    long_one = "def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    assert function_lengths(long_one) == {"long:1": MAX_FUNCTION_LINES + 1}


def test_no_benchmark_history_in_the_frontends_comments() -> None:
    found = {
        str(path.relative_to(FRONTEND)): hits
        for path in _sources()
        if (hits := [t for t in _prose(path.read_text()) if HISTORY.search(t)])
    }
    assert found == {}
    assert HISTORY.search("(bench/RESULTS.md, P8 fourth run)")
