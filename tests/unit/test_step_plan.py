"""The running batch's step plan (`backend/scheduling/step_plan.py`): for given members, which leave
(their client gone) and which the next step computes a row for."""

from __future__ import annotations

from tandem.backend.scheduling.step_plan import Member, StepPlan, checks_cancellation, plan_step


def test_a_step_computes_a_row_for_every_member_short_of_its_limit() -> None:
    members = [Member(rows=1, limit=5), Member(rows=5, limit=5), Member(rows=4, limit=5)]
    assert plan_step(members) == StepPlan(leave=(), step=(0, 2))  # the second has its rows queued


def test_members_whose_client_went_away_leave_and_are_not_stepped() -> None:
    members = [Member(2, 9, cancelled=True), Member(2, 9), Member(9, 9, cancelled=True)]
    assert plan_step(members) == StepPlan(leave=(0, 2), step=(1,))


def test_nothing_to_step_is_an_empty_plan() -> None:
    assert plan_step([]) == StepPlan((), ())
    assert plan_step([Member(3, 3)]) == StepPlan((), ())


def test_clients_are_asked_every_eighth_step_from_the_first() -> None:
    assert [s for s in range(20) if checks_cancellation(s)] == [0, 8, 16]
