"""The fault drills' copy hook, plugged into P through `tandem.faults.hook` (backend/engines/faults.py).

`make_copy_hook(options)` -> the hook P's transfer sender calls on each copy, after its checksum and
before it crosses (direct mode: on a copy of the first row, which lands over D's first slot after the
production write if the hook altered it; transfer/copier.py). Options (JSON, `tandem.faults.options`):
- `delay_every`, `delay_s`: every Nth copy sleeps that long (D's deadline passes while the write is
  still pending);
- `corrupt_every`: every Nth copy has one staged byte flipped after its checksum (D must catch it);
- `hold`: while true, every copy that reaches the hook waits (re-reading the control file every
  5 ms) until it is false again: a copy held for as long as the test needs, released by the test
  (a timed `delay_s` is a guess at how slow the box is; a hold is not). Meant for the control file;
- `control_file`: an absolute path; while it exists, its JSON object overrides those four (a test
  switches faults on a running server by writing it elsewhere and renaming it over; removing it
  releases a hold). Each change restarts the copy count.
Runs on the sender's copy workers; the counter is shared, so "every Nth" counts copies in the order
they reach the hook. This file is loaded by path inside P's worker: it imports nothing of the tests.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("tandem")
KEYS = ("delay_every", "delay_s", "corrupt_every", "hold")
HOLD_POLL_S = 0.005


class CopyFaults:
    def __init__(self, options: dict[str, Any]) -> None:
        unknown = set(options) - {*KEYS, "control_file"}
        if unknown:
            raise ValueError(f"unknown fault options {sorted(unknown)}; known: {[*KEYS, 'control_file']}")
        self.static = {k: options.get(k, 0) for k in KEYS}
        self.control_file = str(options.get("control_file", ""))
        self._lock = threading.Lock()
        self._n = 0
        self._live = dict(self.static)
        self._stamp: tuple[int, int, int] | None = None

    def _current(self) -> dict[str, Any]:
        """Under `_lock`: the static options, overridden by the control file while it exists."""
        if not self.control_file:
            return self._live
        try:
            st = os.stat(self.control_file)
        except FileNotFoundError:
            stamp = None
        else:
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            self._stamp, self._n, self._live = stamp, 0, dict(self.static)
            if stamp is not None:
                try:
                    with open(self.control_file) as fh:
                        values = json.load(fh)
                    self._live.update({k: values[k] for k in KEYS if k in values})
                except (OSError, ValueError, TypeError) as exc:
                    log.error(
                        "fault injection: ignoring unreadable control file %s: %s", self.control_file, exc
                    )
            log.warning("fault injection now %s", self._live)
        return self._live

    def __call__(self, tid: str, staging: torch.Tensor) -> None:
        with self._lock:
            f = self._current()
            self._n += 1
            n = self._n
        if f["hold"]:
            log.warning("fault injection: holding copy %d (%s) until the control file releases it", n, tid)
            while True:
                time.sleep(HOLD_POLL_S)
                with self._lock:
                    if not self._current()["hold"]:
                        break
            log.warning("fault injection: copy %d (%s) released", n, tid)
        if f["corrupt_every"] and n % int(f["corrupt_every"]) == 0:
            flat = staging.reshape(-1).view(torch.uint8)
            flat[flat.numel() // 2] ^= 0xFF
            log.warning("fault injection: corrupted copy %d (%s) after its checksum", n, tid)
        if f["delay_every"] and n % int(f["delay_every"]) == 0:
            log.warning("fault injection: delaying copy %d (%s) by %.2f s", n, tid, float(f["delay_s"]))
            time.sleep(float(f["delay_s"]))


def make_copy_hook(options: dict[str, Any]) -> Callable[[str, torch.Tensor], None]:
    return CopyFaults(options)


HOOK_FILE = os.path.abspath(__file__)


def fault_parameters(**options: Any) -> dict[str, str]:
    """The `prefill` model's parameters that plug this hook in with `options`."""
    return {"tandem.faults.hook": HOOK_FILE, "tandem.faults.options": json.dumps(options)}
