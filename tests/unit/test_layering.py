"""The package map of docs/architecture.md, checked: imports point one way and nothing circles.

Reads every module's imports (module level and inside functions) with `ast`; imports nothing it checks.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("backend", "transfer", "csrc", "serving", "gateway", "cli", "bench")


def _modules() -> dict[str, Path]:
    out = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            out[".".join(["tandem", *parts])] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every module `name` imports, absolute (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod
            yield from (f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES)


GRAPH = {m: {i for i in _imports(m, p)} for m, p in MODULES.items()}

# package -> what it must never import (prefixes)
FORBIDDEN = {
    "tandem.backend": (
        "tandem.serving",
        "tandem.gateway",
        "tandem.cli",
        "tandem.bench",
        "triton_python_backend_utils",
    ),
    "tandem.transfer": ("tandem.backend", "tandem.serving", "tandem.gateway", "tandem.cli", "tandem.bench"),
    "tandem.csrc": ("tandem.backend", "tandem.transfer", "tandem.serving", "tandem.gateway", "tandem.cli"),
    "tandem.serving": ("tandem.gateway", "tandem.cli", "tandem.bench"),
    "tandem.gateway": (
        "tandem.backend",
        "tandem.transfer",
        "tandem.csrc",
        "tandem.cli",
        "tandem.bench",
        "torch",
    ),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down_the_map(package: str) -> None:
    bad = [
        (m, i)
        for m, imports in GRAPH.items()
        if m == package or m.startswith(package + ".")
        for i in imports
        if any(i == f or i.startswith(f + ".") for f in FORBIDDEN[package])
    ]
    assert not bad, f"{package} imports what it must not: {bad}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_round_a_circle() -> None:
    graph = {m: {i for i in imports if i in MODULES and i != m} for m, imports in GRAPH.items()}
    assert _cycles(graph) == []


@pytest.mark.parametrize("depth", [2, 3])
def test_no_package_circle(depth: int) -> None:
    """tandem.backend.model and tandem.backend.kv may not need each other (depth 3), nor backend and
    serving (depth 2)."""

    def group(m: str) -> str:
        return ".".join(m.split(".")[:depth])

    graph: dict[str, set[str]] = {}
    for m, imports in GRAPH.items():
        graph.setdefault(group(m), set()).update(
            group(i) for i in imports if i in MODULES and group(i) != group(m)
        )
    assert _cycles(graph) == []


@pytest.mark.parametrize(
    "modules",
    [
        "tandem.gateway.app, tandem.cli.gateway",  # the HTTP process
        "tandem.serving.supervisor, tandem.serving.launcher, tandem.cli.health",  # tandem-unit, the probe
        "tandem.transfer.control, tandem.serving.api_key",  # the control directory they share
    ],
)
def test_torch_free_processes_import_without_torch(modules: str) -> None:
    """The gateway, the unit's supervisor, the launcher and the readiness probe run where torch may be
    absent (and must not pay its import): block it and import them."""
    code = f"import sys; sys.modules['torch'] = None\nimport {modules}\nprint('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
