"""The README's layout table is the map of the tree: every path it names exists, and every module
of messages/ and worker/ is named, itself or through a folder row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout_paths() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    paths: list[str] = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            paths += re.findall(r"`([^`]+)`", first_cell)
    return paths


def test_every_path_in_the_layout_table_exists() -> None:
    paths = _layout_paths()
    assert len(paths) > 30
    assert [p for p in paths if not (ROOT / p).exists()] == []


def test_every_module_is_in_the_layout_table() -> None:
    named = _layout_paths()
    folders = [p for p in named if p.endswith("/")]
    unnamed = [
        str(path.relative_to(ROOT))
        for package in ("messages", "worker")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
        and str(path.relative_to(ROOT)) not in named
        and not any(str(path.relative_to(ROOT)).startswith(f) for f in folders)
    ]
    assert unnamed == []
