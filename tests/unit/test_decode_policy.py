"""D's admission policy (`backend/scheduling/decode_policy.py`): what each rule admits and refuses,
worked out by hand from a step model whose coefficients the test chooses."""

from __future__ import annotations

import logging

import pytest

from tandem.backend.scheduling.decode_policy import DecodePolicy
from tandem.backend.scheduling.step_model import StepTimeModel
from tandem.backend.settings import BatchSettings


def _model(a_ms: float, per_stream_ms: float) -> StepTimeModel:
    """A fitted model: step = a + per_stream * batch (no context term), from exact samples."""
    m = StepTimeModel()
    m.seed([(b, 0, (a_ms + per_stream_ms * b) / 1e3) for b in range(1, 33) for _ in range(2)])
    return m


def test_batch_room_is_the_first_bound() -> None:
    p = DecodePolicy(BatchSettings(max_batch=4, rate_admission=False), 0.25, StepTimeModel())
    assert p.fits(3, 0, 100) and not p.fits(4, 0, 100)
    assert p.admittable(1, 0) == 3 and p.admittable(4, 0) == 0


def test_the_rate_floor_admits_while_every_member_keeps_its_rate(caplog: pytest.LogCaptureFixture) -> None:
    # budget 10.5 ms a step (floor 1000/10.5 tok/s, no margin); step = 2 + 1 ms/stream: 8 streams
    # (10 ms) fit, 9 (11 ms) do not.
    b = BatchSettings(max_batch=64, rate_floor_tok_s=1000 / 10.5, rate_margin=0.0)
    p = DecodePolicy(b, 0.25, _model(2.0, 1.0))
    assert p.fits(7, 0, 10)  # the 8th: 10 ms
    with caplog.at_level(logging.INFO, logger="tandem"):
        assert not p.fits(8, 0, 10)  # the 9th: 11 ms
        assert not p.fits(8, 0, 10)
    assert sum("rate floor holds" in r.message for r in caplog.records) == 1  # once per hold
    assert p.admittable(0, 0) == 8 and p.admittable(5, 0) == 3
    assert p.fits(0, 0, 10_000)  # an idle engine always admits


def test_draining_starts_above_the_held_fraction() -> None:
    p = DecodePolicy(BatchSettings(), 0.25, StepTimeModel())
    assert not p.draining(0.25) and p.draining(0.2501)
