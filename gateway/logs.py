"""The gateway's log: a repeated warning or error is said once per window, then summarised.

`RepeatSummary` keys a record by logger, level and message template (not its arguments, so
"refused a connection from %s" from 20,000 peers is one kind) and the exception's type. The first
record of a kind in `window_s` goes through; the rest are counted, and the next one let through
after the window says how many were held back (`flush` says it for kinds that went quiet). Records
below WARNING (the access log) pass untouched. Before this, one client holding the gateway's file
descriptors made it log `Too many open files` 71,490 times in a minute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

_Key = tuple[str, int, str, str]


@dataclass
class _Seen:
    since: float
    held: int = 0


class RepeatSummary(logging.Filter):
    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self._seen: dict[_Key, _Seen] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (record.name, record.levelno, str(record.msg), exc)
        now = self.clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen.since < self.window_s:
            seen.held += 1
            return False
        if seen is not None and seen.held:
            record.msg = f"{record.msg} [and {seen.held} more like this in the last {now - seen.since:.0f} s]"
        if len(self._seen) >= 1024:  # many kinds: forget the oldest
            del self._seen[min(self._seen, key=lambda k: self._seen[k].since)]
        self._seen[key] = _Seen(now)
        return True

    def flush(self, logger: logging.Logger) -> None:
        """Say, for each kind still holding records back, how many (at shutdown)."""
        for (name, level, msg, _), seen in list(self._seen.items()):
            if seen.held:
                logger.log(level, "%s: %d more like %r were not logged", name, seen.held, msg)
                seen.held = 0


def configure(level: int = logging.INFO, window_s: float = 10.0) -> RepeatSummary:
    """The process's logging: one stderr handler on the root logger (uvicorn's loggers propagate to
    it), summarising repeats."""
    summary = RepeatSummary(window_s)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    handler.addFilter(summary)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return summary
