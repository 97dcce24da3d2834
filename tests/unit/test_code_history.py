"""No benchmark or CI history in the code's comments and docstrings, anywhere in the worker and
the wire contract: a comment says why the code is as it is; where a number came from belongs to
commit messages and bench/RESULTS.md."""

from __future__ import annotations

import re
from pathlib import Path

from tests.unit.test_frontend_code_shape import HISTORY, _prose

ROOT = Path(__file__).resolve().parents[2]
STORY = re.compile(r"\bissue \d+|\bonce in CI\b|\bCI run\b", re.IGNORECASE)


def test_no_history_in_the_comments_of_worker_and_messages() -> None:
    paths = sorted(p for package in ("worker", "messages") for p in (ROOT / package).rglob("*.py"))
    assert len(paths) > 60
    found = {
        str(path.relative_to(ROOT)): hits
        for path in paths
        if (hits := [t for t in _prose(path.read_text()) if HISTORY.search(t) or STORY.search(t)])
    }
    assert found == {}


def test_the_story_pattern_finds_a_story() -> None:
    assert STORY.search("(seen once in CI: issue 16)")
    assert not STORY.search("CI runs it on a clean clone")
