"""`Intake`: `max_queue` bounds every request the engine has not yet admitted, dropped or failed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tandem.backend.errors import Overloaded, TandemError
from tandem.backend.scheduling.intake import Intake


@dataclass
class _Sink:
    errors: list[TandemError] = field(default_factory=list)
    gone: bool = False

    def fail(self, error: TandemError) -> None:
        self.errors.append(error)

    def cancelled(self) -> bool:
        return self.gone


@dataclass
class _Req:
    sink: _Sink = field(default_factory=_Sink)
    received_s: float = 0.0


def test_requests_moved_to_pending_still_count_against_max_queue():
    intake: Intake[_Req] = Intake(max_queue=3, admission_timeout_s=60.0)
    for _ in range(3):
        intake.submit(_Req())
    intake.pull(0)  # the engine takes them in
    assert len(intake.queued()) == 3  # the engine plans over them, but admits none (no capacity)
    with pytest.raises(Overloaded, match="admission queue is full"):
        intake.submit(_Req())  # a fourth would make four waiting: shed at once
    assert len(intake) == 3


def test_admitted_cancelled_expired_and_failed_requests_free_their_place():
    intake: Intake[_Req] = Intake(max_queue=2, admission_timeout_s=60.0)
    a, b = _Req(), _Req()
    intake.submit(a)
    intake.submit(b)
    intake.pull(0)
    intake.admitted(a)  # admitted: its place is free
    intake.submit(_Req())
    b.sink.gone = True
    assert intake.queued() == []  # cancelled b is dropped
    assert len(b.sink.errors) == 1 and "[CANCELLED]" in str(b.sink.errors[0])
    assert len(intake) == 1
    intake.submit(_Req())
    intake.pull(0)
    intake.expire(now=float("inf"))  # both waited past the bound: UNAVAILABLE
    assert len(intake) == 0
    for _ in range(2):
        intake.submit(_Req())
    intake.fail_all(Overloaded("shutting down"))
    assert len(intake) == 0
    intake.submit(_Req())  # nothing is left holding a place


def test_a_scheduler_plans_over_the_queued_requests_and_the_engine_admits_them_in_order():
    """`queued` is what a scheduler plans over (cancelled ones answered and gone); `admitted` takes the
    head the plan chose, each freeing its place."""
    intake: Intake[_Req] = Intake(max_queue=3, admission_timeout_s=60.0)
    a, b, c = _Req(), _Req(), _Req()
    for req in (a, b, c):
        intake.submit(req)
    intake.pull(0)
    b.sink.gone = True
    assert intake.queued() == [a, c] and len(b.sink.errors) == 1 and len(intake) == 2
    intake.admitted(a)
    assert intake.queued() == [c] and len(intake) == 1
    with pytest.raises(AssertionError):
        intake.admitted(a)  # only the head, in arrival order
    assert not a.sink.errors and not c.sink.errors
