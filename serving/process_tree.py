"""A server's processes, read from /proc: its stubs (which model each serves), its whole tree.

`tandem-unit` watches the stubs of its tritonserver by pid (a python-backend stub is a child of the
server whose argv[1] is `<repository>/<model>/<version>/model.py`): a stub that exits, or is left a
zombie (Triton 2.51 reaps no dead decoupled stub), is seen at the next poll. It also collects a
server's whole tree (stubs, their engine workers) before it signals the server, so that it can kill
what is left afterwards. Linux only; nothing here imports Triton or torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

STUB_BINARY = "triton_python_backend_stub"


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of `pid`, or None when it is gone (the comm field may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def state(pid: int) -> str:
    """`pid`'s state letter (`R`, `S`, `T`, `Z`, ...), or "" when it is gone."""
    st = _stat(pid)
    return "" if st is None else st[0]


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie and not gone."""
    return state(pid) not in ("", "Z", "X")


def argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


def children(ppid: int) -> list[int]:
    """Pids of the live (non-zombie) direct children of `ppid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[1] == ppid and st[0] != "Z":
                out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, parents before their children (one /proc scan)."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] != "Z":
                by_parent.setdefault(st[1], []).append(int(entry))
    out: list[int] = []
    todo = list(by_parent.get(pid, ()))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(by_parent.get(p, ()))
    return out


def stub_model(pid: int, repositories: Iterable[str]) -> str | None:
    """The model a python-backend stub serves, if `pid` is one under one of `repositories`."""
    args = argv(pid)
    if len(args) < 2 or not args[0].endswith(STUB_BINARY):
        return None
    path = Path(args[1])
    for repo in repositories:
        with contextlib.suppress(ValueError):
            rel = path.relative_to(Path(repo).resolve()) if path.is_absolute() else None
            if rel is not None and len(rel.parts) >= 2:
                return rel.parts[0]
    return path.parent.parent.name if path.name == "model.py" else None


def stubs(server_pid: int, repositories: Iterable[str]) -> dict[int, str]:
    """{pid: model} of the server's live model-instance stubs. The stub Triton starts for a model as
    a whole while it loads it (to complete its config; named after the model, not an instance, on
    its command line) lives only for the load and is left out."""
    repos = list(repositories)
    out = {}
    for pid in children(server_pid):
        model = stub_model(pid, repos)
        if model is not None and model not in argv(pid)[2:]:
            out[pid] = model
    return out


def kill_all(pids: Iterable[int], sig: signal.Signals = signal.SIGKILL) -> list[int]:
    """Send `sig` to each of `pids` still alive; returns those it was sent to."""
    sent = []
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent.append(pid)
    return sent
