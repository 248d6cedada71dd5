"""The shell every engine runs in: P, D, the monolithic engine and the voice registrar.

What they all are to their worker (`backend/worker/host.py`): `start` once, `submit` from the worker's
reader thread, `loop_age_s` from its beat thread, `close` once at the end. What they all do the same
way: one loop thread (`tandem-<name>`) that alone touches the engine's state and calls `_iterate`
until `close`; the fault policy below; `close` that stops the loop exactly once.

Faults: an exception escaping an iteration (a bug or a device fault) is logged with its traceback
and handed to `_fault`, which fails every request the engine owns (clients are told at once); the
loop then serves on. An exception inside `_fault` is logged too: the loop survives its own fault
handling.

An engine subclasses the shell and gives `_iterate` and `_fault`; the lifecycle steps around the
loop's start and stop are hooks it may give (`_prepare`, `_started`, `_stopping`, `_stopped`), each
called on the caller's thread of `start` or `close`. It lives at the top of `backend/` rather than in
`backend/engines/` because the registrar (`backend/voices/`) runs in it too, and `backend/engines/`
depends on `backend/voices/` through `backend/text/`.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from typing import Generic, Protocol, TypeVar

log = logging.getLogger("tandem")

R = TypeVar("R")
R_contra = TypeVar("R_contra", contravariant=True)


class Submits(Protocol[R_contra]):
    """A bounded intake: `submit` queues a request or raises Overloaded at once (any thread)."""

    def submit(self, req: R_contra) -> None: ...


class EngineShell(Generic[R]):
    """The loop thread and the four calls a worker makes. `intake` takes what `submit` is given
    (None: the engine overrides `submit`); `join_s` bounds how long `close` waits for the loop."""

    def __init__(self, name: str, intake: Submits[R] | None, join_s: float = 10.0) -> None:
        self._intake = intake
        self._join_s = join_s
        self._stop = threading.Event()
        self._closed = False
        self._began = time.monotonic()  # when the current iteration began (read by `loop_age_s`)
        self._loop = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- what the worker calls ---------------------------------------------------------------------

    def start(self) -> None:
        """Once, on the worker's main thread: `_prepare` (warm-up, calibration: whatever must happen
        before the first request is served), the loop, then `_started`. Raises whatever failed."""
        self._prepare()
        self._loop.start()
        self._started()

    def submit(self, req: R) -> None:
        """The worker's reader thread: hand `req` to the intake; raises Overloaded when it is full
        (the caller tells the client)."""
        assert self._intake is not None, "an engine without an intake overrides submit"
        self._intake.submit(req)

    def loop_age_s(self) -> float:
        """Seconds the loop has been inside its current iteration (the worker's heartbeat; any
        thread): small while the loop turns, growing while one iteration is stuck (a device call
        that never returns, a long registration)."""
        return time.monotonic() - self._began

    def close(self) -> None:
        """Stop the loop: the stop flag, `_stopping` (what must not wait for the loop: stop feeding
        it, wake it), the loop's end (at most `join_s`), then `_stopped`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._stopping()
        if self._loop.is_alive() and threading.current_thread() is not self._loop:
            self._loop.join(self._join_s)
        self._stopped()

    # ---- for the engine ------------------------------------------------------------------------------

    @property
    def loop_alive(self) -> bool:
        """The loop thread is running (False before `start`, and once it ended)."""
        return self._loop.is_alive()

    def _iterate(self) -> None:
        """One pass of the loop (the loop thread only). Returns promptly when idle (a bounded wait),
        so the stop flag is seen."""
        raise NotImplementedError

    def _fault(self, reason: str) -> None:
        """After an iteration raised (the loop thread): fail what the engine owns, `reason` told to
        each client."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Before the loop starts."""

    def _started(self) -> None:
        """Just after the loop started."""

    def _stopping(self) -> None:
        """After the stop flag is set, before the loop is waited for."""

    def _stopped(self) -> None:
        """After the loop ended, or `join_s` passed without it ending (`loop_alive` says which)."""

    def _run(self) -> None:
        name = self._loop.name
        while not self._stop.is_set():
            self._began = time.monotonic()
            try:
                self._iterate()
            except Exception as exc:
                log.error("%s: engine iteration failed:\n%s", name, traceback.format_exc())
                try:
                    self._fault(f"engine fault: {type(exc).__name__}: {exc}")
                except Exception:  # the loop must survive its own fault handling
                    log.error("%s: fault handling failed:\n%s", name, traceback.format_exc())
