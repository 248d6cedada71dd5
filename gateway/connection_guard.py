"""How many connections the gateway holds and for how long a client may leave it waiting: the caps,
their clamp to the descriptor limit, the counts shared by every connection, the write timeout, and
the WebSocket protocol that keeps its connection's slot. `gateway/serve.py` (the HTTP side) says why
each bound exists.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import resource
from collections.abc import Container
from dataclasses import dataclass, replace
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from tandem.gateway.metrics import GatewayMetrics

log = logging.getLogger("tandem.gateway")

FD_RESERVE = 64  # files the gateway opens after start: uploads spooled to disk, logs, pipes


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 4096
    max_per_client: int = (
        512  # per peer address; behind a router, per forwarded client (gateway/forwarded.py)
    )
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    drain_s: float = 2.0
    keep_alive_s: int = 5
    max_header_bytes: int = 16 * 1024
    refused_linger_s: float = 1.0
    write_timeout_s: float = 30.0  # a client that reads nothing for this long while output waits
    linger_cap: int = 256
    backlog: int = 2048  # uvicorn's default listen backlog
    trusted_proxies: tuple[
        str, ...
    ] = ()  # IPs/CIDRs whose X-Forwarded-For is believed (gateway/forwarded.py)


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def open_files() -> int:
    """How many descriptors this process holds now."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


def effective(limits: ServerLimits, fd_limit: int, in_use: int = 0) -> ServerLimits:
    """`limits` with the caps clamped to what `fd_limit` descriptors hold: admitted connections,
    lingering refusals, and one accept batch (asyncio accepts up to `backlog` sockets per wake-up
    before any of them is refused), with the `in_use` descriptors the process holds already and
    `FD_RESERVE` more left for the files it opens later."""
    room = max(16, fd_limit - in_use - FD_RESERVE)
    backlog = max(4, min(limits.backlog, room // 4))
    linger = max(1, min(limits.linger_cap, room // 8))
    cap = max(1, min(limits.max_connections, room - backlog - linger))
    per_client = min(limits.max_per_client, cap)
    return replace(limits, max_connections=cap, max_per_client=per_client, linger_cap=linger, backlog=backlog)


_CUT_LOG = {
    "cap": "gateway: refused a connection from %s: %s",
    "client_cap": "gateway: refused a connection from %s (per client): %s",
    "header_timeout": "gateway: closed a connection from %s: %s",
    "body_timeout": "gateway: closed a connection from %s (body): %s",
    "drain": "gateway: closed a connection from %s (refused body): %s",
    "write_timeout": "gateway: aborted a connection from %s (not reading): %s",
}


class ConnectionGuard:
    """The open-connection counts one server shares across its connections, and their metrics."""

    def __init__(
        self, limits: ServerLimits, metrics: GatewayMetrics | None = None, trusted: Container[str] = ()
    ) -> None:
        self.limits = limits
        self.trusted = trusted  # peers whose connections carry many clients: no cap per peer
        self.metrics = metrics
        self.open = 0
        self.lingering = 0
        self.per_client: collections.Counter[str] = collections.Counter()

    def admit(self, host: str) -> tuple[str, str] | None:
        """None when a connection from `host` may open (counted), else (reason, why)."""
        lim = self.limits
        if self.open >= lim.max_connections:
            return "cap", f"{self.open} connections are open, the cap is {lim.max_connections}"
        if self.per_client[host] >= lim.max_per_client and host not in self.trusted:
            return (
                "client_cap",
                f"{host} holds {self.per_client[host]}, the cap per client is {lim.max_per_client}",
            )
        self.open += 1
        self.per_client[host] += 1
        if self.metrics is not None:
            self.metrics.connections.set(self.open)
        return None

    def release(self, host: str) -> None:
        self.open -= 1
        self.per_client[host] -= 1
        if self.per_client[host] <= 0:
            del self.per_client[host]
        if self.metrics is not None:
            self.metrics.connections.set(self.open)

    def cut(self, reason: str, host: str, why: str) -> None:
        if self.metrics is not None:
            self.metrics.cut.labels(reason=reason).inc()
        log.warning(_CUT_LOG[reason], host, why)  # one template per reason: summarised per reason


class WriteTimer:
    """The write timeout of one connection: armed while its transport has paused the writer (the
    client's window and the kernel's buffers are full), it aborts the transport after
    `write_timeout_s`; abort drops what is queued, so the app's blocked send returns at once."""

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None

    def arm(
        self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, guard: ConnectionGuard, host: str
    ) -> None:
        self.cancel()
        s = guard.limits.write_timeout_s

        def fire() -> None:
            # Also when closing: a close() waits for the queued bytes to go out, which they never do.
            self._handle = None
            guard.cut("write_timeout", host, f"nothing read of what it was sent for {s:g} s")
            transport.abort()

        self._handle = loop.call_later(s, fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


PINGS_EXTENSION = "tandem.client_pings"  # the scope extension that carries a socket's `ClientPings`


class ClientPings:
    """When the client last sent a WebSocket ping (loop time; 0.0: never). websockets answers a
    ping inside the protocol and the app never sees it, yet a ping is the client saying it is
    there: the app reads this (`scope["extensions"][PINGS_EXTENSION]["pings"]`) to count it as
    activity (gateway/ws.py). The client's pongs to the server's own keep-alive pings are not
    counted: every live client's library sends those by itself."""

    def __init__(self) -> None:
        self.last = 0.0
        self.count = 0


class GuardedWebSocket(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (websockets' sans-I/O one) holding the slot of the connection it
    took over (released when it closes), under the write timeout, and telling the app of the
    client's pings (`ClientPings`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slot: tuple[ConnectionGuard, str] | None = None
        self._socket: asyncio.Transport | None = None
        self._write_timer = WriteTimer()
        self.pings = ClientPings()

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        # The app's task is created but not started: it sees the extension from its first step.
        if self.response.status_code == 101:  # else refused: no scope, no app
            extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
            extensions[PINGS_EXTENSION] = {"pings": self.pings}

    def handle_ping(self) -> None:
        self.pings.last = self.loop.time()
        self.pings.count += 1
        super().handle_ping()

    def hold(self, guard: ConnectionGuard, host: str, transport: asyncio.Transport) -> None:
        """Take over the slot of `host`'s connection; `transport` is the socket's own (abortable)."""
        self._slot = (guard, host)
        self._socket = transport

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._slot is not None and self._socket is not None:
            guard, host = self._slot
            self._write_timer.arm(asyncio.get_running_loop(), self._socket, guard, host)

    def resume_writing(self) -> None:
        self._write_timer.cancel()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._write_timer.cancel()
        if self._slot is not None:
            guard, host = self._slot
            self._slot = None
            guard.release(host)
        super().connection_lost(exc)
