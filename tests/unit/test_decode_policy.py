"""D's admission policy (`backend/scheduling/decode_policy.py`): what each rule admits and refuses,
worked out by hand from a step model whose coefficients the test chooses."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from tandem.backend.scheduling.decode_policy import AdmissionPlan, DecodePolicy, Hold, Members
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


def _ahead(*members: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Members as (context, generated rows, limit)."""
    table = np.array(members, dtype=np.int64).reshape(-1, 3)
    return table[:, 0], table[:, 1], table[:, 2]


def _context_model(a_ms: float, per_token_ms: float) -> StepTimeModel:
    """A fitted model: step = a + per_token * total context (no batch term)."""
    m = StepTimeModel()
    m.seed([(b, c, (a_ms + per_token_ms * c) / 1e3) for b in (1, 2, 4, 8) for c in range(0, 3200, 200)])
    return m


def test_the_look_ahead_holds_a_stream_whose_members_will_grow_past_the_floor() -> None:
    # budget 10 ms; step = 1 ms + 0.01 ms/token: 900 tokens of context in all fit.
    b = BatchSettings(max_batch=64, rate_floor_tok_s=100.0, rate_margin=0.0)
    p = DecodePolicy(b, 0.25, _context_model(1.0, 0.01))
    # Now: 300 + 300 tokens and a 100-token newcomer = 700 (8 ms) fits the step of today...
    assert p.fits(2, 600, 100)
    # ...but the two members may each generate 200 more rows (their limit; no lengths learned yet):
    # at the newcomer's last step 1,300 tokens (14 ms) would hold every stream below the floor.
    ahead = _ahead((300, 0, 200), (300, 0, 200))
    assert not p.fits(2, 600, 100, max_new_rows=100, ahead=ahead)
    assert p.fits(2, 600, 100, max_new_rows=0, ahead=_ahead((300, 200, 200), (300, 200, 200)))


def test_learned_lengths_admit_what_the_worst_case_refuses_and_the_tail_runs_to_its_limit() -> None:
    b = BatchSettings(max_batch=64, rate_floor_tok_s=100.0, rate_margin=0.0)
    p = DecodePolicy(b, 0.25, _context_model(1.0, 0.01))
    ahead = _ahead((300, 0, 1000), (300, 0, 1000))
    assert not p.fits(2, 600, 100, max_new_rows=1000, ahead=ahead)  # the guard: limits until learned
    for _ in range(p.lengths.min_samples):
        p.lengths.observe(50)  # streams end on eos after ~50 rows
    assert p.lengths.expected == 50
    assert p.fits(2, 600, 100, max_new_rows=1000, ahead=ahead)  # peak 300+300+100 + 3*49 = 847 tokens
    # A member already past 50 rows is in the tail: expected to run to its limit (1000), refused.
    assert not p.fits(2, 600, 100, max_new_rows=1000, ahead=_ahead((300, 60, 1000), (300, 0, 1000)))


def test_the_peak_is_at_a_stream_s_last_step() -> None:
    m = _context_model(0.0, 1.0)  # step ms = total context
    # A: 100 tokens, 10 rows left; B: 10 tokens, 100 rows left. Both in until A's last step (t = 9):
    # 109 + 19 = 128; then B alone until its last (t = 99): 109.
    assert m.peak(np.array([100, 10]), np.array([10, 100])) * 1e3 == pytest.approx(128.0)
    assert m.peak(np.array([100]), np.array([0])) * 1e3 == pytest.approx(100.0)


def _members(count: int, context: int = 0, free_pages: int = 100, *ahead: tuple[int, int, int]) -> Members:
    """A snapshot as `Membership.view` takes it: one `ahead` row per member (by default each at its
    share of the context, with nothing left to generate)."""
    rows = ahead or tuple((context // max(count, 1), 0, 0) for _ in range(count))
    return Members(count, context, free_pages, _ahead(*rows))


def test_the_plan_names_why_the_head_of_the_queue_waits_in_the_rules_order() -> None:
    """A plan is data: for one snapshot of the members, admit the newcomer with its pages or say which
    rule holds it — draining before batch room before the rate floor before pages."""
    b = BatchSettings(max_batch=4, rate_floor_tok_s=1000 / 10.5, rate_margin=0.0)
    p = DecodePolicy(b, 0.25, _model(2.0, 1.0))  # the rate floor holds the 9th stream; here room holds at 4
    assert p.plan(_members(0), 10, 5, pages=1, draining=False) == AdmissionPlan(1, None)
    assert p.plan(_members(0), 10, 5, pages=1, draining=True).holds is Hold.DRAINING
    assert p.plan(_members(4, free_pages=0), 10, 5, pages=1, draining=False).holds is Hold.BATCH_FULL
    assert p.plan(_members(3, free_pages=1), 10, 5, pages=2, draining=False).holds is Hold.PAGES
    assert p.plan(_members(3, free_pages=2), 10, 5, pages=2, draining=False) == AdmissionPlan(2, None)
    rate = DecodePolicy(replace(b, max_batch=64), 0.25, _model(2.0, 1.0))
    assert rate.plan(_members(8, free_pages=0), 10, 0, pages=1, draining=False).holds is Hold.RATE_FLOOR
    assert rate.plan(_members(7), 10, 0, pages=1, draining=False) == AdmissionPlan(1, None)


def test_the_plan_looks_ahead_at_the_members_in_its_snapshot() -> None:
    """The same newcomer beside the same context: admitted beside members near their end, held beside
    members that may still grow 200 rows each (the look-ahead of the snapshot's `ahead`)."""
    b = BatchSettings(max_batch=64, rate_floor_tok_s=100.0, rate_margin=0.0)
    p = DecodePolicy(b, 0.25, _context_model(1.0, 0.01))
    ending = _members(2, 600, 100, (300, 199, 200), (300, 199, 200))
    growing = _members(2, 600, 100, (300, 0, 200), (300, 0, 200))
    assert p.plan(ending, 100, 100, pages=4, draining=False).holds is None
    assert p.plan(growing, 100, 100, pages=4, draining=False).holds is Hold.RATE_FLOOR
