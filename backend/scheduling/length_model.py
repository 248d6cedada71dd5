"""Online estimate of how many rows a stream still generates, for D's look-ahead admission.

Streams end on their own eos long before `max_new_rows` as a rule, so admission that assumed every
member runs to its limit would refuse streams that fit. This model learns the generated lengths of
finished streams (the last `window`) and answers a member's expected remaining rows as the
`quantile` of them less what it has generated, capped at its limit. Guards: until `min_samples`
streams finished it answers the worst case (the limit), and a member already past the quantile (the
tail the estimate does not cover) is expected to run to its limit.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np


class LengthModel:
    """`observe` from any thread (a stream's end); `remaining` from any thread. One small lock."""

    def __init__(self, quantile: float = 0.9, window: int = 256, min_samples: int = 16) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.min_samples = min_samples
        self._lengths: deque[int] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._expected: int | None = None  # the quantile, once min_samples were seen

    def observe(self, generated: int) -> None:
        """A stream finished (eos or its limit) after `generated` rows; failed and cancelled ones
        say nothing about lengths and are not observed."""
        if generated <= 0:
            return
        with self._lock:
            self._lengths.append(generated)
            if len(self._lengths) >= self.min_samples:
                self._expected = int(np.ceil(np.quantile(np.array(self._lengths), self.quantile)))

    @property
    def expected(self) -> int | None:
        """The learned length (rows), or None while the guard answers the worst case."""
        return self._expected

    def remaining(self, generated: int, max_new_rows: int) -> int:
        """Rows a stream that generated `generated` of at most `max_new_rows` is expected to add."""
        limit = max(0, max_new_rows - generated)
        expected = self._expected
        if expected is None or generated >= expected:
            return limit
        return min(limit, expected - generated)

    def remaining_many(self, generated: np.ndarray, limits: np.ndarray) -> np.ndarray:
        """`remaining` of many streams at once (int64 arrays of equal length)."""
        g = np.asarray(generated, dtype=np.int64)
        limit = np.maximum(np.asarray(limits, dtype=np.int64) - g, 0)
        expected = self._expected
        if expected is None:
            return limit
        return np.where(g >= expected, limit, np.minimum(limit, expected - g))
