"""A server's processes, read from /proc: its stubs (which model each serves), its whole tree.

`tandem-unit` watches the stubs of its tritonserver by pid (a python-backend stub is a child of the
server whose argv is `<stub> <repository>/<model>/<version>/model.py <shm region> ...`): a stub that
exits, or is left a zombie (Triton 2.51 reaps no dead decoupled stub), is seen at the next poll, and
its `/dev/shm` region (argv[2]) is known from when it lived. It also collects a server's whole tree
(stubs, their engine workers) before it signals the server, so that it can kill what is left
afterwards. Linux only; nothing here imports Triton or torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Stub:
    """One model-instance stub as seen alive: its model and its python-backend `/dev/shm` region."""

    model: str
    region: str


def model_of(args: list[str], repositories: Iterable[str]) -> str | None:
    """The model a stub with command line `args` serves, if it is a stub of one of `repositories`."""
    if len(args) < 2 or not args[0].endswith(STUB_BINARY):
        return None
    path = Path(os.path.abspath(args[1]))
    repos = list(repositories)
    for repo in repos:
        for base in {Path(os.path.abspath(repo)), Path(repo).resolve()}:
            with contextlib.suppress(ValueError):
                rel = path.relative_to(base)
                if len(rel.parts) >= 2:
                    return rel.parts[0]
    # `<somewhere>/<model>/<version>/model.py` of a model the repositories hold (a path through a
    # link); a model loaded from files its load request carried (tandem-unit's readiness mark) is none.
    name = path.parent.parent.name
    if path.name == "model.py" and any((Path(r) / name / "config.pbtxt").is_file() for r in repos):
        return name
    return None


def stub_model(pid: int, repositories: Iterable[str]) -> str | None:
    """The model a python-backend stub serves, if `pid` is one under one of `repositories`."""
    return model_of(argv(pid), repositories)


def stub_details(server_pid: int, repositories: Iterable[str]) -> dict[int, Stub]:
    """{pid: Stub} of the server's live model-instance stubs under `repositories`. The stub Triton
    starts for a model as a whole while it loads it (to complete its config, unless that is disabled;
    named after the model, not an instance, on its command line) lives only for the load and is left
    out."""
    repos = list(repositories)
    out = {}
    for pid in children(server_pid):
        args = argv(pid)
        model = model_of(args, repos)
        if model is not None and model not in args[2:]:
            out[pid] = Stub(model, args[2] if len(args) > 2 else "")
    return out


def stubs(server_pid: int, repositories: Iterable[str]) -> dict[int, str]:
    """{pid: model} of the server's live model-instance stubs (`stub_details`)."""
    return {pid: s.model for pid, s in stub_details(server_pid, repositories).items()}


def kill_all(pids: Iterable[int], sig: signal.Signals = signal.SIGKILL) -> list[int]:
    """Send `sig` to each of `pids` still alive; returns those it was sent to."""
    sent = []
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                sent.append(pid)
    return sent
