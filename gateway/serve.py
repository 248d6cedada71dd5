"""tandem-gateway's HTTP server: uvicorn (h11) with the bounds a hostile client needs.

What uvicorn 0.54 provides is used as it is: the keep-alive idle timeout (`timeout_keep_alive`),
h11's bound on a request's head (`h11_max_incomplete_event_size`: past it 400), the listen
backlog. What it lacks, `GuardedH11Protocol` (a subclass of uvicorn's `H11Protocol`) adds:

- **A connection cap with a fast refusal.** uvicorn's `limit_concurrency` answers 503 only once a
  request's head is complete, so a client trickling its headers is never refused and every
  connection it holds keeps a file descriptor (before this: at ~19,984 of 20,000 open files every
  request timed out). Past `max_connections` open, or `max_per_client` from one peer address, a
  new connection is answered 503 (OpenAI's JSON, `Retry-After: 1`) the moment it is accepted, its
  write side shut (so the client reads the 503 rather than a reset) and closed after
  `refused_linger_s` or when the client closes, whichever is first; at most `linger_cap` such
  refusals linger, any more are closed at once.
- **A header timeout**: a request's head (the first, or the next on a kept-alive connection) must
  be complete within `header_timeout_s` of the connection or of the previous response; else 408
  (or a quiet close when no byte of it came).
- **A body timeout**: a request's whole body within `body_timeout_s` of its head (a Content-Length
  larger than what is sent ends here); else 408, or a close when the response has started.
- **A drain bound**: a response sent before its request's body arrived (a 413, any refusal) leaves
  uvicorn discarding the rest of the body; after `drain_s` the connection is closed. Where uvicorn
  would close at once (the request said `Connection: close`), `_LingeringTransport` shuts the
  write side instead and drains the same way, so a client that sends its whole body before reading
  gets the answer, not a reset.

The file-descriptor soft limit is raised to the hard limit at start and the cap (and the listen
backlog, which is also how many sockets asyncio accepts before any is refused) clamped so that
admitted, lingering and just-accepted connections stay `FD_RESERVE` below it (`effective`); the
result is logged once. Before the clamp a client could run the process out of descriptors between
accept and refusal.
Each refusal and cut is counted (`tandem_gateway_connections_cut_total{reason}`) and logged
through `gateway/logs.py`, which summarises repeats.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import resource
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.gateway.http_errors import raw_response
from tandem.gateway.logs import configure
from tandem.gateway.metrics import GatewayMetrics

log = logging.getLogger("tandem.gateway")

FD_RESERVE = 64  # the gateway's own files: its gRPC channel, logs, uploads spooled to disk


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int = 4096
    max_per_client: int = 512  # behind a proxy every client has its address: raise it to the cap
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    drain_s: float = 2.0
    keep_alive_s: int = 5
    max_header_bytes: int = 16 * 1024
    refused_linger_s: float = 1.0
    linger_cap: int = 256
    backlog: int = 2048  # uvicorn's default listen backlog


def raise_fd_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def effective(limits: ServerLimits, fd_limit: int) -> ServerLimits:
    """`limits` with the caps clamped to what `fd_limit` descriptors hold: admitted connections,
    lingering refusals, and one accept batch (asyncio accepts up to `backlog` sockets per wake-up
    before any of them is refused), `FD_RESERVE` left for the gateway's own files."""
    room = max(16, fd_limit - FD_RESERVE)
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
}


class ConnectionGuard:
    """The open-connection counts one server shares across its connections, and their metrics."""

    def __init__(self, limits: ServerLimits, metrics: GatewayMetrics | None = None) -> None:
        self.limits = limits
        self.metrics = metrics
        self.open = 0
        self.lingering = 0
        self.per_client: collections.Counter[str] = collections.Counter()

    def admit(self, host: str) -> tuple[str, str] | None:
        """None when a connection from `host` may open (counted), else (reason, why)."""
        lim = self.limits
        if self.open >= lim.max_connections:
            return "cap", f"{self.open} connections are open, the cap is {lim.max_connections}"
        if self.per_client[host] >= lim.max_per_client:
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


class _LingeringTransport(asyncio.Transport):
    """The connection's transport as uvicorn sees it. uvicorn closes a connection right after a
    response when the request said `Connection: close` (urllib always does), also while that
    request's body is still arriving (a refusal before reading it): the client, still sending, then
    gets a reset instead of the answer. Here such a `close()` shuts the write side only and lets the
    body drain (discarded) until the client closes or `drain_s` passes."""

    def __init__(self, inner: asyncio.Transport, proto: GuardedH11Protocol) -> None:
        super().__init__()
        self.inner = inner
        self.proto = proto
        self.lingering = False

    def close(self) -> None:
        if self.lingering or self.inner.is_closing():
            return
        if self.proto.conn.their_state is h11.SEND_BODY and self.inner.can_write_eof():
            try:
                self.inner.write_eof()
            except OSError:  # the client is gone
                self.inner.close()
                return
            self.lingering = True
            self.proto.linger()
            return
        self.inner.close()

    def is_closing(self) -> bool:
        return self.lingering or self.inner.is_closing()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.lingering:
            self.inner.write(data)

    def write_eof(self) -> None:
        self.inner.write_eof()

    def can_write_eof(self) -> bool:
        return self.inner.can_write_eof()

    def abort(self) -> None:
        self.inner.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.inner.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self.inner.pause_reading()

    def resume_reading(self) -> None:
        self.inner.resume_reading()

    def is_reading(self) -> bool:
        return self.inner.is_reading()

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.inner.get_protocol()

    def get_write_buffer_size(self) -> int:
        return self.inner.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.inner.set_write_buffer_limits(high, low)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the cap and timeouts above; `guard` is set per server (`serve`)."""

    guard: ClassVar[ConnectionGuard]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._host = ""
        self._admitted = False
        self._refused = False
        self._lingering = False
        self._phase = "head"  # head | body | done | drain
        self._got_head_bytes = False
        self._timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._wrapped: _LingeringTransport | None = None

    # -- the cap ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self._host = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        refusal = self.guard.admit(self._host)
        if refusal is not None:
            self._refuse(transport, *refusal)
            return
        self._admitted = True
        self._wrapped = _LingeringTransport(transport, self)
        super().connection_made(self._wrapped)
        self._arm(self.guard.limits.header_timeout_s, self._head_timeout)

    def linger(self) -> None:
        """`_LingeringTransport` shut the write side with the request's body still arriving: read
        (uvicorn may have paused reading while the app did not read) and discard it."""
        self._cancel()
        if self._wrapped is not None and not self._wrapped.inner.is_reading():
            self._wrapped.inner.resume_reading()
        self._linger_timer = self.loop.call_later(self.guard.limits.drain_s, self._lingered)

    def _lingered(self) -> None:
        self._linger_timer = None
        if self._wrapped is not None and not self._wrapped.inner.is_closing():
            s = self.guard.limits.drain_s
            self.guard.cut("drain", self._host, f"a body still arriving {s:g} s after the response")
            self._wrapped.inner.close()

    def _refuse(self, transport: asyncio.Transport, reason: str, why: str) -> None:
        self._refused = True
        self.transport = transport
        self.guard.cut(reason, self._host, why)
        answer = raw_response(503, f"the gateway is at its connection cap: {why}", (("retry-after", "1"),))
        try:
            transport.write(answer)
            if self.guard.lingering < self.guard.limits.linger_cap and transport.can_write_eof():
                transport.write_eof()
                self.guard.lingering += 1
                self._lingering = True
                self._timer = self.loop.call_later(self.guard.limits.refused_linger_s, transport.close)
                return
        except OSError:  # the client is gone already (reset)
            pass
        transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._refused:
            if self._lingering:
                self._lingering = False
                self.guard.lingering -= 1
            return
        self._release()
        super().connection_lost(exc)

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.guard.release(self._host)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._cancel()
        self._release()  # the websocket protocol takes the connection over
        super().handle_websocket_upgrade(event)

    # -- the timeouts -------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused or (self._wrapped is not None and self._wrapped.lingering):
            return  # after a refusal or a response that closes: discarded until the linger ends
        if self._phase == "head":
            self._got_head_bytes = True
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            self._cancel()
        elif self.conn.their_state is h11.SEND_BODY:  # answered before its body came: a refusal
            self._phase = "drain"
            self._arm(self.guard.limits.drain_s, self._drained)
        else:
            self._follow()

    def _follow(self) -> None:
        """Arm the timer of the phase h11 says the request is in."""
        if self.transport.is_closing():
            self._cancel()
            return
        their = self.conn.their_state
        if their is h11.IDLE and self._phase != "head":  # the next request on a kept-alive connection
            self._phase, self._got_head_bytes = "head", False
            self._arm(self.guard.limits.header_timeout_s, self._head_timeout)
        elif their is h11.SEND_BODY and self._phase == "head":
            self._phase = "body"
            self._arm(self.guard.limits.body_timeout_s, self._body_timeout)
        elif their in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED) and self._phase in ("head", "body"):
            self._phase = "done"
            self._cancel()

    def _head_timeout(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        s = self.guard.limits.header_timeout_s
        if self._got_head_bytes:
            self.guard.cut("header_timeout", self._host, f"a request head not complete within {s:g} s")
            self.transport.write(raw_response(408, f"the request's headers did not arrive within {s:g} s"))
        else:
            self.guard.cut("header_timeout", self._host, f"no request within {s:g} s")
        self.transport.close()

    def _body_timeout(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        s = self.guard.limits.body_timeout_s
        self.guard.cut("body_timeout", self._host, f"a request body not complete within {s:g} s")
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            cycle.disconnected = True  # the app's reads end and what it answers is dropped
            cycle.message_event.set()
            self.transport.write(raw_response(408, f"the request body did not arrive within {s:g} s"))
        self.transport.close()

    def _drained(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.guard.cut(
                "drain", self._host, f"a refused body still arriving after {self.guard.limits.drain_s:g} s"
            )
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._cancel()
        self.transport.write(raw_response(400, f"malformed HTTP request: {msg}"))
        self.transport.close()

    def _arm(self, delay_s: float, fire: Any) -> None:
        self._cancel()
        self._timer = self.loop.call_later(delay_s, fire)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def serve(app: FastAPI, host: str, port: int, limits: ServerLimits = ServerLimits()) -> None:
    """Run `app` (the gateway's, `app.state.gateway.metrics` counted) until SIGINT/SIGTERM, the
    process's logging set up by `gateway/logs.py`."""
    summary = configure()
    fd_limit = raise_fd_limit()
    lim = effective(limits, fd_limit)
    metrics = getattr(getattr(app.state, "gateway", None), "metrics", None)
    guard = ConnectionGuard(lim, metrics)
    protocol = type("GatewayProtocol", (GuardedH11Protocol,), {"guard": guard})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        log_config=None,  # gateway/logs.py configured the root logger
        timeout_keep_alive=lim.keep_alive_s,
        backlog=lim.backlog,
        h11_max_incomplete_event_size=lim.max_header_bytes,
    )
    log.info(
        "gateway: at most %d connections (%d per client address; open-files limit %d), request head within"
        " %g s, body within %g s",
        lim.max_connections,
        lim.max_per_client,
        fd_limit,
        lim.header_timeout_s,
        lim.body_timeout_s,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        summary.flush(log)
