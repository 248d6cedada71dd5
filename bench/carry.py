"""What a GPU machine without tandem needs from the carry, checked on the CPU machine that builds it.

The device image has Python 3.12, a CUDA torch, triton, pybind11, cupy and transformers
(`DEVICE_HAS`); everything else that the device scripts run — tritonserver's python stubs and the
engine workers they start (every `model_repository/*/model.py` but `voices`), the launcher and
`tandem-unit`, `tandem-repo`, the benches — must come from the carry (`bench/device/make_carry.sh`):
its `site/` folder, which the device scripts put first on every interpreter's path through a `.pth`
file (Triton's stubs ignore PYTHONPATH).

This machine's Python is not the device's, so the check cannot import the carry's compiled
modules: it resolves them. From the entry modules it follows every `tandem` import (module level
and inside functions; not under `if TYPE_CHECKING:` nor inside `try: ... except ImportError`),
collects every other top-level module named, and requires each to be the standard library's, the
device's, or in the carry (a package, a module, or an extension built for CPython 3.12 or the
stable ABI). Then each carried distribution's own requirements (its METADATA, with the extras
tandem uses) must be carried or on the device.

    python -m tandem.bench.carry SITE_DIR        # prints what is missing; exit 1 if anything is
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: the `tandem` namespace's folders
# The modules the device scripts run; each model.py is what a stub (and its worker) imports.
ENTRIES = (
    "backend/worker/main.py",
    "serving/launcher.py",
    "serving/supervisor.py",
    "cli/make_repository.py",
    "bench/capacity.py",
    "bench/codec.py",
    "bench/trace.py",
)
# Left out of the carry with the models that need them: the registrar (`voices`) decodes uploaded
# references with PyAV (~30 MB of FFmpeg); the device scripts delete it from the bench repository.
LEFT_OUT_MODELS = ("voices",)
# ... and the modules only its worker runs (backend/worker/host.py imports them for kind `voices`).
LEFT_OUT_MODULES = ("backend/voices/registrar.py",)
# Modules the server provides to its stubs (the python backend's folder).
SERVER_PROVIDES = frozenset({"triton_python_backend_utils"})
# Top-level modules of the device image (bench/device/device_env.sh's machine): torch and what it
# imports, triton, pybind11, cupy and its fastrlock; transformers (Mimi's codec, backend/codec/mimi.py).
DEVICE_HAS = frozenset(
    {
        "torch", "torchgen", "functorch", "triton", "pybind11", "cupy", "cupy_backends", "fastrlock",
        "filelock", "typing_extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec",
        "setuptools", "pkg_resources", "_distutils_hack", "nvidia", "transformers",
    }
)  # fmt: skip
DEVICE_DISTS = frozenset(
    {"torch", "triton", "pybind11", "cupy-cuda13x", "fastrlock", "filelock", "typing-extensions", "sympy",
     "mpmath", "networkx", "jinja2", "markupsafe", "fsspec", "setuptools"}
)  # fmt: skip
# The extras of carried distributions that tandem imports (tritonclient.grpc).
EXTRAS = {"tritonclient": {"grpc"}}
# Requirements a carried distribution declares but imports only on paths tandem never takes.
UNUSED_REQUIREMENTS = {
    # snac (`SNAC.from_pretrained`) and tokenizers (`Tokenizer.from_pretrained`) import it to download;
    # tandem reads local directories only
    "huggingface-hub": ("snac", "tokenizers"),
}
_TAG = re.compile(r"\.(cpython-312-x86_64-linux-gnu|abi3)\.so$")


@dataclass(frozen=True)
class Missing:
    name: str  # a top-level module or a distribution
    needed_by: str  # the tandem module that imports it, or the distribution that requires it


def entry_files(root: Path = ROOT) -> list[Path]:
    models = sorted((root / "model_repository").glob("*/*/model.py"))
    kept = [p for p in models if not any(part in LEFT_OUT_MODELS for part in p.parts)]
    return [*kept, *(root / e for e in ENTRIES)]


def _optional(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if any(isinstance(k, ast.Name) and k.id in names for k in kinds):
            return True
    return False


def _imports(tree: ast.AST) -> Iterator[tuple[str, int, list[str]]]:
    """(module, level, names) of every import that runs, skipping TYPE_CHECKING blocks and imports
    guarded by `except ImportError`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Try) and _optional(node):
            stack.extend([*node.handlers, *node.orelse, *node.finalbody])
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0, []
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level, [a.name for a in node.names]
        stack.extend(ast.iter_child_nodes(node))


def _tandem_file(dotted: str, root: Path) -> Path | None:
    """The file of `tandem.a.b` in the checkout (a module or a package's __init__), or None."""
    parts = dotted.split(".")[1:]
    if not parts:
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(["tandem", *parts])


def external_imports(root: Path = ROOT) -> dict[str, str]:
    """Every non-tandem top-level module the entries reach -> the first tandem module naming it."""
    seen: set[Path] = set()
    todo = list(entry_files(root))
    out: dict[str, str] = {}
    while todo:
        path = todo.pop()
        if path in seen or str(path.relative_to(root)) in LEFT_OUT_MODULES:
            continue
        seen.add(path)
        # model.py files import tandem absolutely; only package modules have relative imports
        in_repo = path.is_relative_to(root / "model_repository")
        here = "" if in_repo else _module_of(path, root)
        package = here if path.name == "__init__.py" else here.rpartition(".")[0]
        for module, level, names in _imports(ast.parse(path.read_text(), str(path))):
            if level:
                base = package.split(".")[: len(package.split(".")) - (level - 1)]
                module = ".".join([*base, module] if module else base)
            top = module.split(".")[0]
            if top != "tandem":
                if top and top != "__future__":
                    out.setdefault(top, str(path.relative_to(root)))
                continue
            for dotted in (module, *(f"{module}.{n}" for n in names)):
                found = _tandem_file(dotted, root)
                if found is not None:
                    todo.append(found)
    return out


def carried(site: Path, name: str) -> bool:
    """`name` importable from the carry's `site` folder on CPython 3.12."""
    if (site / name).is_dir() or (site / f"{name}.py").is_file():
        return True
    return any(_TAG.search(p.name) for p in site.glob(f"{name}.*.so"))


def _dists(site: Path) -> dict[str, Path]:
    out = {}
    for info in site.glob("*.dist-info"):
        name = info.name.removesuffix(".dist-info").rsplit("-", 1)[0]
        out[re.sub(r"[-_.]+", "-", name).lower()] = info
    return out


def _requirements(metadata: str, extras: set[str]) -> Iterator[str]:
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line.removeprefix("Requires-Dist:").partition(";")
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if extra and extra.group(1) not in extras:
            continue
        if "python_version" in marker and '< "3' in marker:
            continue
        name = re.match(r"\s*([A-Za-z0-9._-]+)", spec)
        if name:
            yield re.sub(r"[-_.]+", "-", name.group(1)).lower()


def check(site: Path, root: Path = ROOT) -> list[Missing]:
    """What the device would lack with this carry: modules tandem imports, then carried
    distributions' requirements."""
    missing = []
    stdlib = set(sys.stdlib_module_names)
    for name, where in sorted(external_imports(root).items()):
        if name in stdlib or name in DEVICE_HAS or name in SERVER_PROVIDES or carried(site, name):
            continue
        missing.append(Missing(name, where))
    dists = _dists(site)
    for dist, info in sorted(dists.items()):
        meta = (info / "METADATA").read_text(errors="replace")
        for req in _requirements(meta, EXTRAS.get(dist, set())):
            if dist in UNUSED_REQUIREMENTS.get(req, ()):
                continue
            if req not in dists and req not in DEVICE_DISTS:
                missing.append(Missing(req, dist))
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.bench.carry", description=__doc__.split("\n")[0])
    ap.add_argument("site", type=Path, help="the carry's site folder (pip install --target)")
    args = ap.parse_args(argv)
    missing = check(args.site)
    for m in missing:
        print(f"missing: {m.name} (needed by {m.needed_by})")
    names = sorted(external_imports())
    print(f"{len(names)} modules imported besides tandem; {len(missing)} missing from {args.site}")
    return 1 if missing else 0


if __name__ == "__main__":
    raise SystemExit(main())
