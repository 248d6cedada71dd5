"""Online model of D's decode step time, for rate-floor admission.

t ≈ a + b·B + c·ΣL (batch size B, total context ΣL), refitted by least squares over recent steps and
the start-up samples `seed` adds (`backend/engines/decode/calibration.py`), which stay in every fit.
Admission asks whether the batch with the newcomer still keeps every stream at the floor, with a
margin. Until enough distinct steps were seen, it admits (bounded by max_batch).
"""

from __future__ import annotations

from collections import deque

import numpy as np

MIN_SAMPLES = 16


class StepTimeModel:
    def __init__(self, window: int = 512, refit_every: int = 16) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._prior: list[tuple[float, float, float]] = []  # `seed`: kept in every fit
        self._refit_every = refit_every
        self._since_fit = 0
        self.coef: np.ndarray | None = None  # (a, b, c) in seconds

    def observe(self, batch: int, context: int, seconds: float) -> None:
        """Called by the engine thread after every decode step."""
        if batch <= 0 or seconds <= 0:
            return
        self._samples.append((float(batch), float(context), seconds))
        self._since_fit += 1
        if self._since_fit >= self._refit_every and len(self._samples) + len(self._prior) >= MIN_SAMPLES:
            self._fit()

    def seed(self, samples: list[tuple[int, int, float]]) -> None:
        """Called once by D at start-up, before it admits anything, with (batch, context, seconds) of
        timed steps of its own loop; fits at once (so `ready`) when there are enough of them."""
        self._prior = [(float(b), float(c), s) for b, c, s in samples if b > 0 and s > 0]
        if len(self._prior) + len(self._samples) >= MIN_SAMPLES:
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        data = np.array(self._prior + list(self._samples))
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        coef, *_ = np.linalg.lstsq(x, data[:, 2], rcond=None)
        # Step time cannot shrink with more work: clamp slopes at zero, refit the intercept.
        coef[1:] = np.maximum(coef[1:], 0.0)
        coef[0] = max(0.0, float(np.mean(data[:, 2] - x[:, 1:] @ coef[1:])))
        # A model that under-predicts the slowest recent steps would over-admit: lift it to cover p90
        # of the live steps' residuals (the start-up calibration's while too few live steps were seen).
        live = len(self._samples) >= MIN_SAMPLES
        recent = data[len(self._prior) :] if live else data
        xr = x[len(self._prior) :] if live else x
        resid = recent[:, 2] - xr @ coef
        coef[0] += max(0.0, float(np.quantile(resid, 0.9)))
        self.coef = coef

    @property
    def ready(self) -> bool:
        return self.coef is not None

    def predict(self, batch: int, context: int) -> float:
        if self.coef is None:
            return 0.0
        a, b, c = self.coef
        return float(a + b * batch + c * context)

    def admits(self, batch: int, context: int, new_context: int, floor_tok_s: float, margin: float) -> bool:
        """Would every stream stay >= floor if one stream with `new_context` tokens joined?

        An idle engine always admits: one stream is the best it can do, and only running steps refresh
        the fit — refusing with an empty batch would keep a pessimistic model forever (D admits nothing).
        """
        if not self.ready or batch == 0:
            return True
        budget = (1.0 - margin) / floor_tok_s
        return self.predict(batch + 1, context + new_context) <= budget

    def peak(self, contexts: np.ndarray, remaining: np.ndarray) -> float:
        """The largest step predicted while these streams (context, rows still to generate) grow by
        one row a step and each leaves after its remaining rows, nobody joining. Between two leaves
        the step only grows, so each stream's last step is where a peak can be."""
        if self.coef is None or len(contexts) == 0:
            return 0.0
        order = np.argsort(-np.asarray(remaining), kind="stable")
        ctx = np.asarray(contexts, dtype=np.float64)[order]
        last = np.maximum(np.asarray(remaining, dtype=np.float64)[order] - 1.0, 0.0)
        alive = np.arange(1, len(ctx) + 1, dtype=np.float64)  # streams still in at each one's last step
        a, b, c = self.coef
        return float(np.max(a + b * alive + c * (np.cumsum(ctx) + alive * last)))

    def admits_ahead(
        self, contexts: np.ndarray, remaining: np.ndarray, floor_tok_s: float, margin: float
    ) -> bool:
        """`admits` over the batch's future: the members' real contexts and expected remaining rows
        (the newcomer among them) must keep every stream >= floor at the predicted peak step. An
        idle engine (only the newcomer) always admits."""
        if not self.ready or len(contexts) <= 1:
            return True
        return self.peak(contexts, remaining) <= (1.0 - margin) / floor_tok_s

    def admittable(
        self, batch: int, context: int, typical_context: int, floor_tok_s: float, margin: float, limit: int
    ) -> int:
        """How many more streams of `typical_context` tokens fit under the floor (the scaling signal)."""
        room = max(0, limit - batch)
        if not self.ready:
            return room
        for k in range(room):
            if not self.admits(
                batch + k, context + k * typical_context, typical_context, floor_tok_s, margin
            ):
                return k
        return room
