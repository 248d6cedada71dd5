"""What a worker's engine records between heartbeats, carried to its stub by the next Beat."""

from __future__ import annotations

import threading

from tandem.backend.worker.channel import Beat


class BeatMetrics:
    """A MetricsSink that accumulates until `beat()` takes what it holds: the worker's sink (the next
    Beat carries what the engine recorded to the stub), and the stub's merge of Beats that queued
    while it published (`record`). Gauges keep their last value, counter increments are summed,
    histogram samples kept in order. Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sets: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._incs: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self._observes: list[tuple[str, dict[str, str], float]] = []

    def set(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._sets[(name, tuple(sorted(labels.items())))] = float(value)

    def inc(self, name: str, by: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._incs[key] = self._incs.get(key, 0.0) + float(by)

    def observe(self, name: str, value: float, **labels: str) -> None:
        with self._lock:
            self._observes.append((name, dict(labels), float(value)))

    def record(self, beat: Beat) -> None:
        """Fold a Beat's metrics in, as if recorded here."""
        beat.replay(self)

    def beat(self, loop_age_s: float) -> Beat:
        """A Beat with everything recorded since the last one (then forgotten here)."""
        with self._lock:
            sets, incs, obs = self._sets, self._incs, self._observes
            self._sets, self._incs, self._observes = {}, {}, []
        return Beat(
            loop_age_s,
            [(n, dict(lab), v) for (n, lab), v in sets.items()],
            [(n, dict(lab), v) for (n, lab), v in incs.items()],
            obs,
        )
