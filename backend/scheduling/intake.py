"""Bounded intake shared by the engines: a full queue is an immediate UNAVAILABLE, and so is a request
not admitted within `admission_timeout_s`; a request whose client went away is dropped unworked.

`max_queue` bounds every request submitted and not yet admitted, dropped, expired or failed, in the
hand-off queue and in the engine's pending list alike (docs/abuse.md).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Generic, Protocol, TypeVar

from tandem.backend.errors import Cancelled, Overloaded, TandemError


class _HasSink(Protocol):
    received_s: float

    @property
    def sink(self) -> _SinkLike: ...


class _SinkLike(Protocol):
    def fail(self, error: TandemError) -> None: ...

    def cancelled(self) -> bool: ...


R = TypeVar("R", bound=_HasSink)


class Intake(Generic[R]):
    """Producer side: Triton's execute threads call `submit`; consumer side: the engine thread."""

    def __init__(self, max_queue: int, admission_timeout_s: float) -> None:
        self._queue: queue.SimpleQueue[R] = queue.SimpleQueue()
        self._pending: deque[R] = deque()  # engine side only
        self.max_queue = max_queue
        self.admission_timeout_s = admission_timeout_s
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet admitted, dropped, expired or failed (under _lock)

    def submit(self, req: R) -> None:
        """Raises Overloaded at once when `max_queue` requests are already waiting."""
        req.received_s = time.monotonic()
        with self._lock:
            if self._waiting >= self.max_queue:
                raise Overloaded(f"admission queue is full ({self.max_queue} requests waiting)")
            self._waiting += 1
        self._queue.put(req)

    def __len__(self) -> int:
        """Requests waiting for admission (any thread)."""
        return self._waiting

    def _gone(self, n: int = 1) -> None:
        """`n` pending requests left the intake (admitted, dropped, expired or failed)."""
        with self._lock:
            self._waiting -= n

    def pull(self, block_s: float) -> None:
        """Move newly submitted requests into the pending list, waiting up to block_s for the first."""
        try:
            if block_s > 0:
                self._pending.append(self._queue.get(timeout=block_s))
            while True:
                self._pending.append(self._queue.get_nowait())
        except queue.Empty:
            pass

    def queued(self) -> list[R]:
        """The pending requests in arrival order (the engine's thread), for a scheduler to plan over;
        those whose client went away are dropped first (answered CANCELLED). They stay pending until
        `admitted` takes them."""
        if any(req.sink.cancelled() for req in self._pending):
            keep: deque[R] = deque()
            for req in self._pending:
                if req.sink.cancelled():
                    self._gone()
                    req.sink.fail(Cancelled("client cancelled before admission"))
                else:
                    keep.append(req)
            self._pending = keep
        return list(self._pending)

    def admitted(self, req: R) -> None:
        """`req`, the first pending request, is admitted: it leaves the intake (its answer is now the
        engine's)."""
        assert self._pending and self._pending[0] is req, "requests are admitted in arrival order"
        self._pending.popleft()
        self._gone()

    def expire(self, now: float) -> None:
        """Requests pending since before `now - admission_timeout_s` fail with UNAVAILABLE (the engine
        calls it after each admission round, with the time the round began)."""
        keep: deque[R] = deque()
        for req in self._pending:
            if now - req.received_s > self.admission_timeout_s:
                self._gone()
                req.sink.fail(
                    Overloaded(f"no capacity within the admission wait of {self.admission_timeout_s:g} s")
                )
            else:
                keep.append(req)
        self._pending = keep

    def fail_all(self, error: TandemError) -> None:
        self.pull(0)
        pending, self._pending = self._pending, deque()
        self._gone(len(pending))
        for req in pending:
            req.sink.fail(error)
