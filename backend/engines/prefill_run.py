"""One prefill forward as the engine runs it: shared by P and the monolithic engine.

The scheduler decided which prompts go (`backend/scheduling/prefill_plan.py`); here they get their
pages (`admit`), go through the one forward (`forward`: the family's `RowStep.first_rows`, each
member's row 0 made with its own parameters, stamps, metrics), and are handed on one by one by the
engine (`P`: the KV offer and HANDOFF; mono: the running batch), which marks each with `handed`.

Ownership: a member's prefix-cache allocation and its answer belong to the run from `admit` until
`handed`; then to whatever the engine handed it to, also when that raised. `fail_rest` answers and
releases every member not handed on; the engine calls it on any error and lets the error reach the
shell's fault policy.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from tandem.backend.errors import PoolExhausted, TandemError
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.kv.pool import KVPool
from tandem.backend.kv.prefix_cache import PrefixAllocation, PrefixCache
from tandem.backend.metrics import MetricsSink
from tandem.backend.model.decoder import PrefillItem
from tandem.backend.model.row_step import RowStep
from tandem.backend.scheduling.intake import Intake
from tandem.backend.scheduling.prefill_plan import plan_prefill
from tandem.backend.settings import BatchSettings
from tandem.backend.timing import Timings

log = logging.getLogger("tandem")


class _Sink(Protocol):
    def fail(self, error: TandemError) -> None: ...

    def cancelled(self) -> bool: ...


class _Request(Protocol):
    received_s: float
    max_new_rows: int

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def prompt(self) -> np.ndarray: ...

    @property
    def sink(self) -> _Sink: ...

    @property
    def timings(self) -> Timings: ...


R = TypeVar("R", bound=_Request)


def extra_tokens(req: _Request, decode_room: bool) -> int:
    """The tokens a prompt's pages hold beyond the prompt: its decode rows where it decodes in the
    same pool (the monolithic engine), none on P."""
    return req.max_new_rows if decode_room else 0


class PrefillRun(Generic[R]):
    """The members of one forward and their allocations (the engine thread only)."""

    def __init__(self, cache: PrefixCache, metrics: MetricsSink) -> None:
        self.cache = cache
        self.metrics = metrics
        self.members: list[tuple[R, PrefixAllocation]] = []
        self._handed = 0  # members[:_handed] belong to whoever they were handed to

    def __len__(self) -> int:
        return len(self.members)

    def take(
        self, intake: Intake[R], limits: BatchSettings, decode_room: bool, room: int | None = None
    ) -> None:
        """Plan the forward over the intake's head (`plan_prefill`: the queued prompts' lookups, the
        cache's available pages, `room` the running batch's free places or None) and admit what the plan
        takes, then expire what waited too long. `decode_room`: the pages also hold each prompt's decode
        rows (mono). Raises what admitting raises; the caller then calls `fail_rest`."""
        now = time.monotonic()
        queued = intake.queued()
        lookups = (self.cache.lookup(req.prompt, extra_tokens(req, decode_room)) for req in queued)
        plan = plan_prefill(lookups, self.cache.available_pages, limits, room)
        self.admit(intake, queued[: plan.take], decode_room, now)
        intake.expire(now)

    def admit(self, intake: Intake[R], planned: Sequence[R], decode_room: bool, now_s: float) -> None:
        """The plan's prompts (the intake's head, in order) get their pages and leave the intake, each
        a member from then on. One the pool refuses after all (the cache evicted a page another
        planned prompt counted on) stays queued with every prompt behind it."""
        for req in planned:
            try:
                alloc = self.cache.allocate(req.prompt, extra_tokens=extra_tokens(req, decode_room))
            except PoolExhausted:
                return
            intake.admitted(req)
            self.members.append((req, alloc))
            req.timings.mark("admit")
            self.metrics.observe("tandem_admission_seconds", now_s - req.received_s)

    def forward(self, step: RowStep, pool: KVPool, tables: Sequence[torch.Tensor]) -> np.ndarray:
        """The one forward (`step`: the family's decoder and row maker, backend/model/row_step.py).
        `tables[i]` holds member i's slots, at least one per prompt row (the rows its prefix-cache hit
        covers are read, the rest written). Stamps and measures every member's forward; returns each
        member's row 0 (made with its own parameters) [n, W]."""
        items = []
        for (req, alloc), table in zip(self.members, tables, strict=True):
            rows = torch.from_numpy(req.prompt[alloc.cached_tokens :]).to(pool.device)
            items.append(PrefillItem(rows, table[: req.prompt.shape[0]], alloc.cached_tokens))
        for req, _ in self.members:
            req.timings.mark("forward_start")
        params = [req.sampling for req, _ in self.members]
        starts = [req.prompt.shape[0] for req, _ in self.members]
        firsts = step.first_rows(pool, items, params, starts).numpy()
        for req, alloc in self.members:
            req.timings.mark("forward_end")
            self.metrics.observe(
                "tandem_prefill_seconds",
                (req.timings.get("forward_end") - req.timings.get("forward_start")) / 1e9,
            )
            self.metrics.inc("tandem_prefix_cache_hit_tokens_total", alloc.cached_tokens)
        self.metrics.observe("tandem_prefill_batch", len(self.members))
        return firsts

    def handed(self, i: int) -> None:
        """Member `i` is being handed on: its pages and its answer are the callee's from now on, also
        when the hand-off raises."""
        self._handed = i + 1

    def fail_rest(self, error: TandemError) -> None:
        """Every member not handed on: pages back, client told (one raising sink stops nothing)."""
        rest, self._handed = self.members[self._handed :], len(self.members)
        for req, alloc in rest:
            if not alloc.released:
                self.cache.release(alloc)
            try:
                req.sink.fail(error)
            except Exception:
                log.exception("could not tell a prefill client its request failed")
