"""Admission's length model (`backend/scheduling/length_model.py`): the guard, the learned quantile,
the tail, and what it is not taught by."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.backend.scheduling.length_model import LengthModel


def test_until_enough_streams_finished_the_answer_is_the_limit() -> None:
    m = LengthModel(min_samples=4)
    for _ in range(3):
        m.observe(10)
    assert m.expected is None and m.remaining(0, 1200) == 1200 and m.remaining(100, 1200) == 1100


def test_the_quantile_of_finished_lengths_less_what_was_generated() -> None:
    m = LengthModel(quantile=0.9, min_samples=10)
    for n in range(10, 110, 10):  # 10, 20, ..., 100
        m.observe(n)
    assert m.expected == int(np.ceil(np.quantile(np.arange(10, 110, 10), 0.9)))  # 91
    assert m.remaining(0, 1200) == 91 and m.remaining(90, 1200) == 1
    assert m.remaining(0, 40) == 40  # never past the stream's own limit
    assert m.remaining(91, 1200) == 1109  # past the estimate: the tail runs to its limit
    many = m.remaining_many(np.array([0, 90, 0, 91]), np.array([1200, 1200, 40, 1200]))
    assert many.tolist() == [91, 1, 40, 1109]


def test_the_window_forgets_old_lengths_and_empty_streams_teach_nothing() -> None:
    m = LengthModel(quantile=1.0, window=4, min_samples=4)
    for n in (500, 500, 500, 500, 0, 0):
        m.observe(n)
    assert m.expected == 500
    for _ in range(4):
        m.observe(20)
    assert m.expected == 20


def test_a_bad_quantile_is_refused() -> None:
    with pytest.raises(ValueError, match="quantile"):
        LengthModel(quantile=0.0)
