"""One control connection: a socket, its frame reader and a send lock. Shared by sender and receiver."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .frames import FrameReader, MsgType, encode, send_frame

SEND_TIMEOUT_S = 2.0


class Connection:
    """Owned by the thread that reads it; any thread may `send` or `shutdown`.

    Only the reader thread closes the fd (in `finish`), after its last read: closing from another thread
    while the reader sits in recvmsg could let the fd number be reused under it. `shutdown` wakes it.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(sock)
        self._send_lock = threading.Lock()
        self._alive = True

    @property
    def alive(self) -> bool:
        return self._alive

    def send(self, kind: MsgType, fds: tuple[int, ...] = (), **fields: Any) -> bool:
        """Send one frame; False (and the connection shut down) if it could not be written whole."""
        frame = encode(kind, **fields)
        with self._send_lock:
            if not self._alive:
                return False
            try:
                send_frame(self.sock, frame, fds, SEND_TIMEOUT_S)
                return True
            except OSError:
                self._shutdown_locked()
                return False

    def later(self, kind: MsgType, **fields: Any) -> Callable[[], None]:
        """A deferred `send`, for callers that decide under their lock and send after releasing it."""

        def send_it() -> None:
            self.send(kind, **fields)

        return send_it

    def shutdown(self) -> None:
        with self._send_lock:
            self._shutdown_locked()

    def _shutdown_locked(self) -> None:
        if self._alive:
            self._alive = False
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        """Called once by the reader thread as it exits."""
        self.shutdown()
        self.reader.close_fds()
        self.sock.close()


def accepted(
    server: socket.socket, stop: threading.Event, tick: Callable[[], None] | None = None
) -> Iterator[socket.socket]:
    """The connections `server` accepts, each made blocking, until `stop` is set or the listener
    closes. `server` must have a timeout (so `stop` is seen); `tick` runs before each accept."""
    while not stop.is_set():
        if tick is not None:
            tick()
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        sock.settimeout(None)
        yield sock
