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

- **A WebSocket keeps its slot.** An upgraded connection stays counted under both caps until it
  closes (`GuardedWebSocket`): before, the upgrade gave the slot back, and 1,000 sockets of one
  address were held while the gauge read 1. A socket past either cap is refused (503) when its
  connection is accepted, before any upgrade. No HTTP deadline (head, body, keep-alive) applies to
  an upgraded connection: how long a socket may stay quiet is its own (`gateway/ws.py`).
- **A write timeout**: a response (HTTP, SSE) or a WebSocket whose client stops reading fills the
  socket's buffers and pauses the writer; paused for `write_timeout_s` the connection is aborted
  (`reason="write_timeout"`), its app ends as on a hang-up (before, an SSE client that never read
  was still connected after 300 s with 2.8 MB queued).

The file-descriptor soft limit is raised to the hard limit at start and the cap (and the listen
backlog, which is also how many sockets asyncio accepts before any is refused) clamped so that
admitted, lingering and just-accepted connections stay below it by the descriptors the process
already holds at start (Triton's channel, the interpreter's, its libraries') plus `FD_RESERVE`
(what it opens later: uploads spooled to disk, logs, the decode children's pipes) (`effective`);
the result is logged once. Before the clamp a client could run the process out of descriptors
between accept and refusal. Should descriptors run out anyway, accept backs off
(`gateway/accept_loop.py`).
Each refusal and cut is counted (`tandem_gateway_connections_cut_total{reason}`) and logged
through `gateway/logs.py`, which summarises repeats.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any, ClassVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from tandem.gateway.connection_guard import (
    ConnectionGuard,
    GuardedWebSocket,
    ServerLimits,
    WriteTimer,
    effective,
    open_files,
    raise_fd_limit,
)
from tandem.gateway.forwarded import ClientCap, Trusted
from tandem.gateway.http_errors import raw_response
from tandem.gateway.logs import configure

log = logging.getLogger("tandem.gateway")
SWITCH_INTERVAL_S = 0.001


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
        self._phase = "head"  # head | body | done | drain | upgraded
        self._got_head_bytes = False
        self._timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._wrapped: _LingeringTransport | None = None
        self._write_timer = WriteTimer()

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
        self._write_timer.cancel()
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
        self._write_timer.cancel()
        # No HTTP deadline applies past the upgrade: h11 still reads the GET as sending its body, and
        # `_follow` (run after this, in the same `data_received`) armed the body timeout, which cut
        # every socket 60 s after it opened. The socket's own idle limit is gateway/ws.py's.
        self._phase = "upgraded"
        super().handle_websocket_upgrade(event)
        # The websocket protocol takes the connection over, and its slot with it.
        ws = self.transport.get_protocol()
        if self._admitted and isinstance(ws, GuardedWebSocket) and self._wrapped is not None:
            self._admitted = False
            ws.hold(self.guard, self._host, self._wrapped.inner)
        else:
            self._release()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._wrapped is not None:
            self._write_timer.arm(self.loop, self._wrapped.inner, self.guard, self._host)

    def resume_writing(self) -> None:
        self._write_timer.cancel()
        super().resume_writing()

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
        if self._phase == "upgraded":
            return
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


def serve(app: FastAPI, host: str, port: int, limits: ServerLimits | None = None) -> None:
    """Run `app` (the gateway's, `app.state.gateway.metrics` counted) until SIGINT/SIGTERM, the
    process's logging set up by `gateway/logs.py`."""
    summary = configure()
    # The text thread (gateway/sentences.py) holds the GIL in slices of this: the loop waits at most
    # one slice for it per wake-up (Python's default, 5 ms, made a bystander's request wait longer).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    fd_limit = raise_fd_limit()
    lim = effective(limits or ServerLimits(), fd_limit, open_files())
    metrics = getattr(getattr(app.state, "gateway", None), "metrics", None)
    guard = ConnectionGuard(lim, metrics, Trusted(lim.trusted_proxies))
    protocol = type("GatewayProtocol", (GuardedH11Protocol,), {"guard": guard})
    # Behind a router: uvicorn rewrites the client from a trusted peer's X-Forwarded-For, and
    # ClientCap caps each forwarded client (gateway/forwarded.py).
    asgi: Any = ClientCap(app, guard) if lim.trusted_proxies else app
    config = uvicorn.Config(
        asgi,
        proxy_headers=bool(lim.trusted_proxies),
        forwarded_allow_ips=list(lim.trusted_proxies) or None,
        host=host,
        port=port,
        http=protocol,
        ws=GuardedWebSocket,
        loop="tandem.gateway.accept_loop:GatewayLoop",
        log_config=None,  # gateway/logs.py configured the root logger
        timeout_keep_alive=lim.keep_alive_s,
        backlog=lim.backlog,
        h11_max_incomplete_event_size=lim.max_header_bytes,
    )
    if lim.trusted_proxies:
        log.info(
            "gateway: trusted proxies %s: their X-Forwarded-For names the client, capped at %d in flight",
            ", ".join(lim.trusted_proxies),
            lim.max_per_client,
        )
    log.info(
        "gateway: at most %d connections, WebSockets included (%d per client address; open-files limit"
        " %d), request head within %g s, body within %g s, a stalled reader cut after %g s",
        lim.max_connections,
        lim.max_per_client,
        fd_limit,
        lim.header_timeout_s,
        lim.body_timeout_s,
        lim.write_timeout_s,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        summary.flush(log)
