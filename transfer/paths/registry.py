"""The one builder from a typed description to a transfer path.

Who calls: each engine that moves KV (P and D), once at start, through `build_path`; tests and benches
that want an unprobed path by name, through `path_factories`. Nothing registers itself on import and nothing
here reads the environment: a path gets what it needs (the unit its proxy sidecar serves, the KV layout
the sidecar checks, the tcp addresses and secret) from `PathOptions`. Building a factory touches no
CUDA, so a CPU host can still select `host_shm`; only `probe()` (in `select_path`) does.

`select_path` probes each candidate with a real small transfer and never falls back silently: with
`require` set, any failure raises `PathUnavailable`; without it, each skipped path is logged as a
warning and the chosen name is what the engine publishes on its info metric.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..control import DEFAULT_UNIT
from ..errors import PathUnavailable
from ..layout import WireLayout
from .base import TransferPath
from .cuda import CudaIpcPath, CudaVmmPath
from .host_shm import HostShmPath
from .proxy import ProxyPath
from .tcp import TcpPath

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PathOptions:
    """What the paths need from the engine that builds them."""

    unit: str = DEFAULT_UNIT  # the unit whose proxy sidecar `proxy` talks to (`tandem-proxy --unit`)
    layout: WireLayout | None = None  # sent with every proxy registration; the sidecar refuses others
    bind_host: str = "127.0.0.1"  # tcp: D's data listener
    advertise_host: str = ""  # tcp: the address peers are told ("" = bind_host)
    secret_file: str = ""  # tcp: the unit secret ("" = the unit's control directory's)


NAMES = (HostShmPath.name, CudaIpcPath.name, CudaVmmPath.name, ProxyPath.name, TcpPath.name)


def path_factories(opts: PathOptions | None = None) -> dict[str, Callable[[], TransferPath]]:
    """Unprobed path factories by name, bound to `opts`."""
    o = opts or PathOptions()
    return {
        HostShmPath.name: HostShmPath,
        CudaIpcPath.name: CudaIpcPath,
        CudaVmmPath.name: CudaVmmPath,
        ProxyPath.name: lambda: ProxyPath(unit=o.unit, layout=o.layout),
        TcpPath.name: lambda: TcpPath(
            bind_host=o.bind_host, advertise_host=o.advertise_host or None, secret_file=o.secret_file or None
        ),
    }


def select_path(
    preferred: Sequence[str],
    require: str | None,
    registry: Mapping[str, Callable[[], TransferPath]],
) -> TransferPath:
    """Probe paths and return the first that works. Called once per process at engine start.

    With `require`, only that path is probed and any failure raises `PathUnavailable`. Without it the
    candidates are probed in `preferred` order; each failure is logged as a warning (never silent) and
    `PathUnavailable` lists every reason if none works.
    """
    reg = registry
    names = [require] if require is not None else list(preferred)
    reasons: list[str] = []
    for name in names:
        factory = reg.get(name)
        if factory is None:
            reasons.append(f"{name}: not a known path ({sorted(reg)})")
            continue
        path = factory()
        try:
            path.probe()
        except PathUnavailable as exc:
            reasons.append(f"{name}: {exc}")
            if require is None:
                log.warning("transfer path %s unavailable, trying the next: %s", name, exc)
            continue
        if reasons:
            log.warning("transfer path %s chosen after skipping: %s", name, "; ".join(reasons))
        return path
    raise PathUnavailable("no transfer path works: " + "; ".join(reasons or ["no candidates"]))


def build_path(preferred: Sequence[str], require: str | None, opts: PathOptions) -> TransferPath:
    """The first of `preferred` that probes; with `require`, that one or `PathUnavailable` (never
    another: a path that is not the one asked for is never chosen silently)."""
    return select_path(preferred, require, path_factories(opts))
