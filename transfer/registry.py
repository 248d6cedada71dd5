"""The one builder from a typed description to a transfer path.

Who calls: each engine that moves KV (P and D), once at start, through `build_path`; tests and benches
that want an unprobed path by name, through `path_factories`. Nothing registers itself on import and nothing
here reads the environment: a path gets what it needs (the unit its proxy sidecar serves, the KV layout
the sidecar checks, the tcp addresses and secret) from `PathOptions`. Building a factory touches no
CUDA, so a CPU host can still select `host_shm`; only `probe()` (in `select_path`) does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cuda_paths import CudaIpcPath, CudaVmmPath
from .layout import WireLayout
from .paths import HostShmPath, TransferPath, select_path
from .proxy_path import ProxyPath
from .tcp_path import TcpPath


@dataclass(frozen=True)
class PathOptions:
    """What the paths need from the engine that builds them."""

    unit: str = "default"  # the unit whose proxy sidecar `proxy` talks to (`tandem-proxy --unit`)
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


def build_path(preferred: Sequence[str], require: str | None, opts: PathOptions) -> TransferPath:
    """The first of `preferred` that probes; with `require`, that one or `PathUnavailable` (never
    another: a path that is not the one asked for is never chosen silently)."""
    return select_path(preferred, require, path_factories(opts))
