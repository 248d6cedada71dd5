"""The loop thread every engine runs on, and its one policy for faults.

An exception escaping an iteration (a bug or a device fault) fails every stream the engine owns
(clients are told at once), is logged with its traceback, and the engine keeps serving. All engine
state is touched by this thread alone.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger("tandem")


class EngineThread:
    def __init__(self, name: str, iterate: Callable[[], None], on_fault: Callable[[str], None]) -> None:
        self._iterate = iterate
        self._on_fault = on_fault
        self._stop = threading.Event()
        self._began = time.monotonic()  # when the current iteration began (read by the worker's heartbeat)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def age_s(self) -> float:
        """Seconds since the current iteration began: small while the loop turns, growing while one
        iteration is stuck (a device call that never returns). Any thread."""
        return time.monotonic() - self._began

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._began = time.monotonic()
            try:
                self._iterate()
            except Exception as exc:
                log.error("%s: engine iteration failed:\n%s", self._thread.name, traceback.format_exc())
                try:
                    self._on_fault(f"engine fault: {type(exc).__name__}: {exc}")
                except Exception:  # the loop must survive its own fault handling
                    log.error("%s: fault handling failed:\n%s", self._thread.name, traceback.format_exc())
