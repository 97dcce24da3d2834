"""The package layering, read from the source (no import runs): which package may import what,
and no import cycle among the project's modules."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUBLISHER_SIDE = ("worker.client", "worker.frontend")
PUBLISHER_MAY_IMPORT = ("messages", "worker.shared", "worker.config", *PUBLISHER_SIDE)


def _modules(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    """Every absolute module an import statement names, lazy imports inside functions included
    (`from a.b import c` names `a.b`, and `a.b.c` when that is a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(
                f"{node.module}.{alias.name}"
                for alias in node.names
                if _is_module(f"{node.module}.{alias.name}")
            )
    return names


def _top_level(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def _project_graph() -> dict[str, set[str]]:
    paths = _modules("worker", "messages")
    known = {_module_name(p) for p in paths}
    return {_module_name(p): {n for n in _imports(p) if n in known} for p in paths}


# The frontend's one module that may import vllm (vLLM's request classes and output parsers),
# and only inside functions: plain requests run without vllm installed.
FRONTEND_VLLM_MODULE = ROOT / "worker" / "frontend" / "vllm_parsers.py"


def test_only_the_engine_package_and_the_frontends_parsers_import_vllm() -> None:
    engine = ROOT / "worker" / "engine"
    offenders = [
        str(p.relative_to(ROOT))
        for p in _modules("worker", "messages")
        if "vllm" in _top_level(_imports(p))
        and engine not in p.parents
        and p != FRONTEND_VLLM_MODULE
    ]
    assert offenders == []
    assert "vllm" in _top_level(_imports(FRONTEND_VLLM_MODULE))


def _module_level_vllm_imports(source: str) -> list[int]:
    """Lines of `import vllm…` / `from vllm… import` statements outside every function."""
    tree = ast.parse(source)
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inside.update(id(child) for child in ast.walk(node) if child is not node)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(n == "vllm" or n.startswith("vllm.") for n in names) and id(node) not in inside:
            lines.append(node.lineno)
    return lines


def test_the_frontends_vllm_imports_are_lazy() -> None:
    """Every vllm import of worker/frontend/vllm_parsers.py is inside a function."""
    assert _module_level_vllm_imports(FRONTEND_VLLM_MODULE.read_text()) == []


def test_the_laziness_check_finds_a_module_level_import() -> None:
    planted = "import os\nfrom vllm.parser import X\ndef f():\n    import vllm\n"
    assert _module_level_vllm_imports(planted) == [2]


def _import_blocking(blocked: tuple[str, ...], modules: str) -> None:
    """Imports `modules` in a fresh interpreter where importing any of `blocked` fails."""
    code = (
        "import sys\n"
        f"for blocked in {blocked!r}:\n"
        "    sys.modules[blocked] = None  # importing it now raises ImportError\n"
        f"import {modules}\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_frontend_imports_without_vllm_or_torch() -> None:
    _import_blocking(
        ("vllm", "torch"), "worker.frontend.app, worker.frontend.cli, worker.frontend.vllm_parsers"
    )


def test_only_the_nats_packages_and_the_publisher_side_import_nats() -> None:
    allowed = [ROOT / "worker" / name for name in ("nats", "shared", "client", "frontend")]
    offenders = [
        str(p.relative_to(ROOT))
        for p in _modules("worker", "messages")
        if "nats" in _top_level(_imports(p)) and not any(a in p.parents for a in allowed)
    ]
    assert offenders == []


def test_the_wire_contract_imports_msgspec_and_nothing_of_the_worker() -> None:
    offenders = {
        str(p.relative_to(ROOT)): sorted(_top_level(_imports(p)) & {"worker", "nats", "vllm"})
        for p in _modules("messages")
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_publisher_side_imports_only_the_wire_contract_and_worker_shared() -> None:
    """client/ and frontend/ never import the worker's engine, service, session or NATS side:
    what both sides use lives in worker.shared (and worker.config: defaults, the environment)."""
    offenders: dict[str, list[str]] = {}
    for path in _modules("worker/client", "worker/frontend"):
        project = {n for n in _imports(path) if n.split(".")[0] in ("worker", "messages")}
        bad = sorted(
            n
            for n in project
            if n != "worker"
            and not any(n == ok or n.startswith(ok + ".") for ok in PUBLISHER_MAY_IMPORT)
        )
        if bad:
            offenders[str(path.relative_to(ROOT))] = bad
    assert offenders == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                cycles.append(path[path.index(imported) :] + [imported])
            elif imported not in state:
                visit(imported)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    # A package's __init__ importing its own modules is not a cycle of concerns.
    return [
        c for c in cycles if not any(b.startswith(a + ".") for a, b in zip(c, c[1:], strict=False))
    ]


def test_no_import_cycle_among_the_projects_modules() -> None:
    """A cycle (lazy imports included) would mean two modules own one concern between them."""
    graph = _project_graph()
    assert sum(len(v) for v in graph.values()) > 50  # the graph was read, not empty
    assert "messages.codec" in graph["worker.service"]
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a": {"a.x"}}
    assert _cycles(graph) == [["a.x", "a.y", "a.z", "a.x"]]


def test_messages_and_the_client_import_without_vllm_or_torch() -> None:
    _import_blocking(
        ("vllm", "torch", "transformers"),
        "messages, worker.client, worker.client.__main__, worker.config",
    )
