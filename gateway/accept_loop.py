"""The gateway's event loop: asyncio's selector loop, except that running out of file descriptors
on accept backs off instead of spinning.

asyncio's `_accept_connection` (CPython 3.11-3.13) handles `EMFILE`/`ENFILE`/`ENOBUFS`/`ENOMEM` from
`accept()` by removing the listening socket's reader and retrying it after 1 s, but does not leave
its accept loop: the same wake-up tries `backlog` (2,048) more accepts, each failing, each logging
and each scheduling one more retry, so the retries multiply (measured before this: 214,563 such
errors in 10 s, a busy accept loop for 40 s, a bystander's request timing out). `GatewayLoop` ends
the wake-up at the first such error and retries once after `ACCEPT_BACKOFF_S`; the warning goes
through `gateway/logs.py`, which prints one line per 10 s however many repeat. The connection cap
(`gateway/serve.py`) keeps the gateway below its descriptor limit, so this is the backstop for
descriptors something else used up.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Any

log = logging.getLogger("tandem.gateway")

ACCEPT_BACKOFF_S = 1.0  # asyncio's own retry delay
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class GatewayLoop(asyncio.SelectorEventLoop):
    """uvicorn's loop for the gateway (`serve.py` names it as the loop factory)."""

    def _accept_connection(
        self,
        protocol_factory: Any,
        sock: socket.socket,
        sslcontext: Any = None,
        server: Any = None,
        backlog: int = 100,
        *timeouts: Any,
    ) -> None:
        for _ in range(backlog):
            try:
                conn, addr = sock.accept()
                conn.setblocking(False)
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in _OUT_OF:
                    raise  # the loop logs and ignores it, as asyncio's does
                log.warning(
                    "gateway: cannot accept a connection (%s): retrying in %g s", exc, ACCEPT_BACKOFF_S
                )
                self._remove_reader(sock.fileno())  # type: ignore[attr-defined]
                self.call_later(
                    ACCEPT_BACKOFF_S,
                    self._start_serving,  # type: ignore[attr-defined]
                    protocol_factory,
                    sock,
                    sslcontext,
                    server,
                    backlog,
                    *timeouts,
                )
                return  # asyncio's goes on accepting here, failing and re-arming each time
            accept = self._accept_connection2(  # type: ignore[attr-defined]
                protocol_factory, conn, {"peername": addr}, sslcontext, server, *timeouts
            )
            self.create_task(accept)
