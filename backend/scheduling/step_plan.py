"""What one decode step computes, decided: for the running batch of D and of the monolithic engine.

`plan_step` reads each running stream as a `Member` (rows it has, with the one a queued step computes
for it; its limit; whether its client went away) and returns a `StepPlan`: which streams leave before
the step (their client is gone: CANCELLED) and which the step computes a row for. It runs nothing;
the running batch (`backend/engines/batch.py`) drops the ones that leave and queues the step.

Rules: a client is asked whether it went away only every `CANCEL_CHECK_EVERY` steps (each ask is a
call into its sink; `checks_cancellation`); a stream is stepped while its rows, the queued one
included, are fewer than its `max_new_rows`. A stream ended by EOS has left the batch already.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CANCEL_CHECK_EVERY = 8  # steps between two asks of every running client whether it went away


def checks_cancellation(step: int) -> bool:
    """Whether step number `step` (counted from 0) asks every client whether it went away."""
    return step % CANCEL_CHECK_EVERY == 0


@dataclass(frozen=True)
class Member:
    """One running stream as the step plan sees it."""

    rows: int  # rows generated, plus the one a queued step computes for it
    limit: int  # its max_new_rows
    cancelled: bool = False  # its client went away (read on the steps that check only)


@dataclass(frozen=True)
class StepPlan:
    """One step: `leave`, the members (by index) whose client went away; `step`, the members it
    computes a row for, in batch order. Empty `step`: nothing to queue."""

    leave: tuple[int, ...]
    step: tuple[int, ...]


def plan_step(members: Sequence[Member]) -> StepPlan:
    leave = tuple(i for i, m in enumerate(members) if m.cancelled)
    step = tuple(i for i, m in enumerate(members) if not m.cancelled and m.rows < m.limit)
    return StepPlan(leave, step)
