"""The package map of docs/architecture.md, checked: imports point one way and nothing circles.

Reads every module's imports (module level and inside functions) with `ast`; imports nothing it checks.
Each room's allowed imports are read from the map's table ("may import"), so the doc and the check
cannot drift apart.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("backend", "transfer", "csrc", "serving", "gateway", "cli", "bench", "wire")


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
    "tandem.wire": (
        "tandem.backend",
        "tandem.transfer",
        "tandem.csrc",
        "tandem.serving",
        "tandem.gateway",
        "tandem.cli",
        "tandem.bench",
        "torch",
        "tritonclient",
        "triton_python_backend_utils",
    ),
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


# ---- the map's table: each room imports only itself and what its "may import" cell names ------------

DOC = ROOT / "docs" / "architecture.md"
BACKEND_SUBPACKAGES = frozenset(p.parent.name for p in (ROOT / "backend").glob("*/__init__.py"))


def _resolve(name: str, top: str) -> str:
    """A name of the table (`transfer`, `serving.health`, `kv`, `settings`) as a module prefix: a
    top-level folder's, or else a module of the row's own top-level package (`kv` in a backend row)."""
    return f"tandem.{name}" if name.split(".")[0] in TOPS else f"tandem.{top}.{name}"


def _map_rules() -> dict[str, tuple[str, ...] | None]:
    """Room -> the module prefixes it may import (None: anything). Rooms: `tandem.<folder>`,
    `tandem.backend.<subpackage>`, and `tandem.backend:top` for the backend's top-level modules.
    Parenthesised words of a cell are comments (which module needs it), not names."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index("## The map: one line per package")
    table = text[start : text.index("\n## ", start + 1)]
    rules: dict[str, tuple[str, ...] | None] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([a-z_/]+)/`( top level)?", cells[0])
        if not line.startswith("| `") or m is None or m.group(1).split("/")[0] not in TOPS:
            continue
        parts = m.group(1).split("/")
        room = ".".join(["tandem", *parts]) + (":top" if m.group(2) else "")
        rule = cells[-1]
        if rule == "anything":
            rules[room] = None
        elif rule == "nothing of tandem":
            rules[room] = ()
        else:
            names = re.findall(r"`([a-z_.]+)`", re.sub(r"\([^)]*\)", "", rule))
            assert names, f"{room}: no module named in its cell {rule!r}"
            rules[room] = tuple(_resolve(n, parts[0]) for n in names)
    return rules


RULES = _map_rules()


def _in_room(module: str, room: str) -> bool:
    if room == "tandem.backend:top":
        parts = module.split(".")
        return module == "tandem.backend" or (
            len(parts) >= 3 and parts[1] == "backend" and parts[2] not in BACKEND_SUBPACKAGES
        )
    return module == room or module.startswith(room + ".")


def _named_imports(name: str, path: Path) -> Iterator[str]:
    """The tandem modules `name` imports: for `from pkg import sub`, the submodule, not the package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.startswith("tandem."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("tandem."):
                continue
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES]
            yield from subs or [mod]


def test_the_map_has_a_row_for_every_room() -> None:
    rooms = {f"tandem.{t}" for t in TOPS} | {f"tandem.backend.{p}" for p in BACKEND_SUBPACKAGES}
    assert rooms | {"tandem.backend:top"} <= set(RULES), sorted(rooms - set(RULES))


@pytest.mark.parametrize("room", sorted(r for r, allowed in RULES.items() if allowed is not None))
def test_each_room_imports_only_what_the_map_allows(room: str) -> None:
    allowed = RULES[room] or ()
    bad = sorted(
        (m, i)
        for m, path in MODULES.items()
        if _in_room(m, room)
        for i in _named_imports(m, path)
        if not _in_room(i, room)
        and not m.startswith(i + ".")  # a package above the importer (its own parents' __init__)
        and not any(i == a or i.startswith(a + ".") for a in allowed)
    )
    assert not bad, f"{room} imports what docs/architecture.md's map does not allow it: {bad}"
