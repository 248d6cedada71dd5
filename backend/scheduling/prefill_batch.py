"""The prompts one prefill forward takes: shared by P and the monolithic engine.

In arrival order, every queued prompt that fits one forward (`Decoder.prefill_many`): at most
`prefill_batch_max` prompts and `prefill_batch_rows` rows (a longer prompt runs alone). A prompt
whose first page another member is computing waits for the next forward (then a prefix-cache hit).
The batch owns its members' prefix-cache allocations until the engine hands each on; `fail_rest`
answers and releases whatever was not handed on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from tandem.backend.errors import PoolExhausted, StreamFailed, TandemError
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.kv.pool import KVPool
from tandem.backend.kv.prefix_cache import PrefixAllocation, PrefixCache
from tandem.backend.metrics import MetricsSink
from tandem.backend.model.decoder import PrefillItem
from tandem.backend.model.row_step import RowStep
from tandem.backend.scheduling.intake import Intake
from tandem.backend.settings import BatchSettings
from tandem.backend.timing import Timings

log = logging.getLogger("tandem")


class _Sink(Protocol):
    def fail(self, error: TandemError) -> None: ...


class _Request(Protocol):
    received_s: float

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def prompt(self) -> np.ndarray: ...

    @property
    def sink(self) -> _Sink: ...

    @property
    def timings(self) -> Timings: ...


R = TypeVar("R", bound=_Request)


class PrefillBatch(Generic[R]):
    def __init__(self, cache: PrefixCache, settings: BatchSettings, metrics: MetricsSink) -> None:
        self.cache = cache
        self.settings = settings
        self.metrics = metrics
        self.members: list[tuple[R, PrefixAllocation]] = []
        self._rows = 0
        self._computing: set[bytes] = set()  # first-page keys this batch computes (not cached yet)
        self._handed = 0  # members[:_handed] belong to their streams now

    def __len__(self) -> int:
        return len(self.members)

    def reserve(self, req: R, now_s: float, extra_tokens: int = 0) -> bool:
        """Admission: `req` joins this forward with its pages, or False (it waits for the next)."""
        b = self.settings
        if len(self.members) >= max(1, b.prefill_batch_max):
            return False
        cached, first = self.cache.peek(req.prompt)
        rows = req.prompt.shape[0] - cached
        if self.members and (self._rows + rows > b.prefill_batch_rows or first in self._computing):
            return False
        try:
            alloc = self.cache.allocate(req.prompt, extra_tokens=extra_tokens)
        except PoolExhausted:
            return False
        if alloc.cached_tokens == 0 and first is not None:
            self._computing.add(first)
        self._rows += req.prompt.shape[0] - alloc.cached_tokens
        req.timings.mark("admit")
        self.metrics.observe("tandem_admission_seconds", now_s - req.received_s)
        self.members.append((req, alloc))
        return True

    def run(self, intake: Intake[R], admit: Callable[[R], bool], prefill: Callable[[], None]) -> None:
        """One engine iteration's prefill: admit queued requests in order while `admit(req)` (which
        calls `reserve`) says yes, then `prefill()` if any was admitted. On any error every member not
        handed on is answered and freed, and the error propagates to the engine's fault handler."""
        try:
            for _ in intake.admit(admit):
                pass
            if self.members:
                prefill()
        except BaseException as exc:
            self.fail_rest(StreamFailed(f"prefill failed: {type(exc).__name__}: {exc}"))
            raise

    def forward(self, step: RowStep, pool: KVPool, tables: Sequence[torch.Tensor]) -> np.ndarray:
        """The batch's one forward (`step`: the family's decoder and row maker). `tables[i]` holds
        member i's slots, at least one per prompt row (the rows its prefix-cache hit covers are read,
        the rest written). Stamps and measures every member's forward; returns each member's row 0
        (made with its own parameters) [n, W]."""
        items = []
        for (req, alloc), table in zip(self.members, tables, strict=True):
            rows = torch.from_numpy(req.prompt[alloc.cached_tokens :]).to(pool.device)
            items.append(PrefillItem(rows, table[: req.prompt.shape[0]], alloc.cached_tokens))
        for req, _ in self.members:
            req.timings.mark("forward_start")
        params = [req.sampling for req, _ in self.members]
        firsts = step.first_rows(
            pool, items, params, [req.prompt.shape[0] for req, _ in self.members]
        ).numpy()
        for req, alloc in self.members:
            req.timings.mark("forward_end")
            self.metrics.observe(
                "tandem_prefill_seconds",
                (req.timings.get("forward_end") - req.timings.get("forward_start")) / 1e9,
            )
            self.metrics.inc("tandem_prefix_cache_hit_tokens_total", alloc.cached_tokens)
        self.metrics.observe("tandem_prefill_batch", len(self.members))
        return firsts

    def hand_on(self, each: Callable[[R, PrefixAllocation, int], None]) -> None:
        """Call `each(req, alloc, i)` per member in order; a member counts as handed on once called:
        its pages and its answer are then the callee's, also when the callee raises. If one raises,
        the members after it are failed and released, and the error propagates (the engine's fault
        handler takes it)."""
        for i, (req, alloc) in enumerate(self.members):
            self._handed = i + 1
            try:
                each(req, alloc, i)
            except Exception as exc:
                self.fail_rest(StreamFailed(f"prefill hand-off failed: {type(exc).__name__}: {exc}"))
                raise

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
