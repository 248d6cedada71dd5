"""D's admission policy: whether one more stream may join, and how many more would fit.

Pure decisions over numbers: D's admission thread asks `plan` under its lock with one snapshot of the
members (`Members`) and gets an `AdmissionPlan` back (admit the head of the queue with its pages, or
why it waits); it runs nothing, the admission thread reserves and pulls. D's gauges ask `admittable`.
Rules, in order:
- draining: quarantined receive memory above `transfer.drain_held_fraction` admits nothing until
  proofs free it (docs/failure-semantics.md);
- batch room: at most `batch.max_batch` members;
- rate floor (`batch.rate_admission`): the step predicted with the newcomer must keep every member
  at `batch.rate_floor_tok_s` less `batch.rate_margin`. Given the members' real contexts and
  generated rows (`ahead`), the check looks ahead: each stream grows by its expected remaining rows
  (`LengthModel`, learned from finished streams, the worst case until it has seen enough) and the
  peak step must fit (`StepTimeModel.admits_ahead`); else the step now (`StepTimeModel.admits`);
- pages: the pool must have free pages for the prompt and its `max_new_rows`.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import numpy as np

from tandem.backend.scheduling.length_model import LengthModel
from tandem.backend.scheduling.step_model import StepTimeModel
from tandem.backend.settings import BatchSettings

log = logging.getLogger("tandem")

Ahead = tuple[np.ndarray, np.ndarray, np.ndarray]  # every member's (contexts, generated rows, limits)


@dataclass(frozen=True)
class Members:
    """One snapshot of D's members, taken under its lock (`Membership.view`)."""

    count: int  # admitted and not gone
    context: int  # KV tokens of the running members and of the admitted ones not yet running
    free_pages: int
    ahead: Ahead


class Hold(enum.Enum):
    """Why the request at the head of D's queue waits."""

    DRAINING = "quarantined receive memory is over transfer.drain_held_fraction"
    BATCH_FULL = "batch.max_batch members"
    RATE_FLOOR = "the step predicted with it would break the rate floor"
    PAGES = "the pool has not its pages free"


@dataclass(frozen=True)
class AdmissionPlan:
    """D's decision for the head of its queue: admit it holding `pages` pages (`holds` None), or it
    waits for the reason `holds` names until capacity comes back."""

    pages: int
    holds: Hold | None


class DecodePolicy:
    """Called by D's admission thread (`fits`, `draining`) and engine thread (`admittable`); the only
    state it keeps is whether a rate hold was logged, touched by the admission thread alone."""

    def __init__(self, batch: BatchSettings, drain_held_fraction: float, step_model: StepTimeModel) -> None:
        self.batch = batch
        self.drain_held_fraction = drain_held_fraction
        self.step_model = step_model
        self.lengths = LengthModel()
        self._rate_holding = False  # the rate floor is holding newcomers (logged once per hold)

    def draining(self, held_fraction: float) -> bool:
        """True while quarantined receive memory is over the drain threshold."""
        return held_fraction > self.drain_held_fraction

    def plan(
        self, members: Members, prompt_len: int, max_new_rows: int, pages: int, draining: bool
    ) -> AdmissionPlan:
        """The newcomer (`prompt_len` rows, at most `max_new_rows` to generate, `pages` pages for
        both) beside `members`; `draining` from `draining(held_fraction)`, read outside the lock."""
        if draining:
            return AdmissionPlan(pages, Hold.DRAINING)
        if members.count >= self.batch.max_batch:
            return AdmissionPlan(pages, Hold.BATCH_FULL)
        if not self.fits(members.count, members.context, prompt_len, max_new_rows, members.ahead):
            return AdmissionPlan(pages, Hold.RATE_FLOOR)
        if pages > members.free_pages:
            return AdmissionPlan(pages, Hold.PAGES)
        return AdmissionPlan(pages, None)

    def fits(
        self,
        members: int,
        context: int,
        prompt_len: int,
        max_new_rows: int = 0,
        ahead: Ahead | None = None,
    ) -> bool:
        """One more stream of `prompt_len` (at most `max_new_rows` to generate) beside `members`
        streams of total `context`; `ahead`: the members' (contexts, generated rows, limits)."""
        b = self.batch
        if members >= b.max_batch:
            return False
        if b.rate_admission and not self._rate_fits(members, context, prompt_len, max_new_rows, ahead):
            self._note_rate_hold(members, context + prompt_len)
            return False
        self._rate_holding = False
        return True

    def _rate_fits(
        self,
        members: int,
        context: int,
        prompt_len: int,
        max_new_rows: int,
        ahead: Ahead | None,
    ) -> bool:
        b = self.batch
        if ahead is None:
            return self.step_model.admits(members, context, prompt_len, b.rate_floor_tok_s, b.rate_margin)
        contexts, generated, limits = ahead
        remaining = self.lengths.remaining_many(np.append(generated, 0), np.append(limits, max_new_rows))
        return self.step_model.admits_ahead(
            np.append(contexts, prompt_len), remaining, b.rate_floor_tok_s, b.rate_margin
        )

    def admittable(self, members: int, context: int) -> int:
        """How many more streams of this batch's typical context fit now (the scaling gauge)."""
        b = self.batch
        if not b.rate_admission:
            return max(0, b.max_batch - members)
        typical = context // members if members else 1024
        return self.step_model.admittable(
            members, context, typical, b.rate_floor_tok_s, b.rate_margin, b.max_batch
        )

    def _note_rate_hold(self, n: int, context: int) -> None:
        """The rate floor holds a newcomer. Logged once per hold (not per 5 ms retry) with the model's
        numbers, so a server log shows why streams wait."""
        if self._rate_holding:
            return
        self._rate_holding = True
        b = self.batch
        coef = self.step_model.coef
        a, per_stream, per_token = (
            (float(coef[0]) * 1e3, float(coef[1]) * 1e3, float(coef[2]) * 1e3)
            if coef is not None
            else (0, 0, 0)
        )
        log.info(
            "decode: rate floor holds admission at %d streams, context %d: predicted step %.1f ms > "
            "budget %.1f ms (model a=%.2f ms, b=%.3f ms/stream, c=%.3g ms/token)",
            n + 1,
            context,
            self.step_model.predict(n + 1, context) * 1e3,
            (1.0 - b.rate_margin) / b.rate_floor_tok_s * 1e3,
            a,
            per_stream,
            per_token,
        )
