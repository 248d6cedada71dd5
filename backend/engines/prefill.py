"""P: prompt forward, first row, and the offer of the prompt's KV to D.

    execute thread: validate + pack (native) -> Intake (bounded)
    engine thread:  plan (`plan_prefill`: which queued prompts one forward takes)
                    -> prefix-cache allocate -> forward -> sample row 0 -> cache commit
                    -> sender.offer(gather) -> HANDOFF (ticket + row 0 + seed + timings)
    sender threads: on D's PULL, copy the rows across, then `on_source_released`

P's pages for a prompt belong to the transfer sender from `offer` until `on_source_released`; the
engine thread releases them only then (`_released`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from tandem.backend.engine_shell import EngineShell
from tandem.backend.engines.faults import copy_hook
from tandem.backend.engines.handoff import Handoff
from tandem.backend.engines.parts import control_secret, make_intake, make_pool, transfer_path, wire_layout
from tandem.backend.engines.prefill_run import PrefillRun
from tandem.backend.errors import Cancelled, StreamFailed, TandemError
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.kv.prefix_cache import PrefixAllocation, PrefixCache
from tandem.backend.metrics import MetricsSink, PublishTimer
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.row_step import RowStep, TokenRowStep
from tandem.backend.model.warm_up import warm_up
from tandem.backend.settings import EngineSettings
from tandem.backend.timing import Timings
from tandem.transfer import TransferSender

log = logging.getLogger("tandem")


class HandoffSink(Protocol):
    def send(self, handoff: Handoff) -> None: ...

    def fail(self, error: TandemError) -> None: ...

    def cancelled(self) -> bool: ...


@dataclass
class PrefillRequest:
    stream_id: int
    prompt: np.ndarray  # int64 [T, W]
    sampling: SamplingParams
    max_new_rows: int
    sink: HandoffSink
    timings: Timings
    received_s: float = 0.0


class PrefillEngine(EngineShell[PrefillRequest]):
    def __init__(
        self,
        decoder: Decoder,
        settings: EngineSettings,
        metrics: MetricsSink,
        slot: str,
        on_fatal: Callable[[str], None],
        row_step: RowStep | None = None,
    ) -> None:
        """`row_step`: the family's row maker over `decoder` (backend/model/row_step.py; None: a
        plain decoder's head and sampler)."""
        self.decoder = decoder
        self.rows = TokenRowStep(decoder) if row_step is None else row_step
        self.settings = settings
        self.metrics = metrics
        self._publish_timer = PublishTimer()
        t = settings.transfer
        self.path = transfer_path(settings, wire_layout(decoder))
        # The proxy path writes D's pool from P's pool itself, so it must have allocated (registered) it.
        n_slots = settings.pool.num_pages * settings.pool.page_size
        direct = t.direct_write and self.path.direct_write
        storage = self.path.source_storage(wire_layout(decoder), n_slots) if direct else None
        self.pool = make_pool(decoder, settings, storage)
        self.cache = PrefixCache(self.pool, enabled=settings.pool.prefix_cache)
        self.intake = make_intake(settings, PrefillRequest)
        super().__init__("tandem-prefill", self.intake)
        self._open: dict[str, PrefixAllocation] = {}
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.sender = TransferSender(
            wire_layout(decoder),
            t.unit,
            self.path,
            on_source_released=self._released.put,
            on_fatal=on_fatal,
            slot=slot,
            max_held_acks=t.max_held_acks,
            copy_hook=copy_hook(settings.faults),
            control=t.control,
            bind_host=t.bind_host,
            advertise_host=t.advertise_host or None,
            secret=control_secret(settings),
        )

    def _prepare(self) -> None:
        warm_up(self.decoder, self.pool)
        self.sender.start()

    def _started(self) -> None:
        log.info(
            "prefill: transfer path %s, endpoint %s, instance %s",
            self.path.name,
            self.sender.endpoint,
            self.sender.instance_id,
        )

    def _stopped(self) -> None:
        self.sender.close()

    def _iterate(self) -> None:
        """Give back what D pulled; then the scheduler's plan over the queue, run: the planned prompts
        get their pages, go through one forward and are handed on (`_prefill`). On any error every
        prompt of the forward not handed on fails and its pages come back; the error goes on to the
        shell's fault policy."""
        self._release_sources()
        self.intake.pull(0.02)
        run: PrefillRun[PrefillRequest] = PrefillRun(self.cache, self.metrics)
        try:
            run.take(self.intake, self.settings.batch, decode_room=False)
            if run:
                self._prefill(run)
        except BaseException as exc:
            run.fail_rest(StreamFailed(f"prefill failed: {type(exc).__name__}: {exc}"))
            raise
        if self._publish_timer.due():
            self._publish()

    def _release_sources(self) -> None:
        while True:
            try:
                tid = self._released.get_nowait()
            except queue.Empty:
                return
            alloc = self._open.pop(tid, None)
            if alloc is not None:
                self.cache.release(alloc)

    def _prefill(self, run: PrefillRun[PrefillRequest]) -> None:
        """One forward over the run's prompts, then per prompt in order: row 0, cache commit, the KV
        offer and the HANDOFF. A hand-off that raises fails the prompts after it, then raises."""
        tables = [self.pool.slots(alloc.pages, req.prompt.shape[0]) for req, alloc in run.members]
        firsts = run.forward(self.rows, self.pool, tables)
        for i, (req, alloc) in enumerate(run.members):
            run.handed(i)
            try:
                self._hand_off(req, alloc, tables[i], firsts[i])
            except Exception as exc:
                run.fail_rest(StreamFailed(f"prefill hand-off failed: {type(exc).__name__}: {exc}"))
                raise

    def _hand_off(
        self, req: PrefillRequest, alloc: PrefixAllocation, slots: torch.Tensor, first: np.ndarray
    ) -> None:
        """Row 0 is known and the prompt's KV is in the pool: commit it to the prefix cache, offer it
        to D (the sender owns the pages until it releases them) and send the HANDOFF. On any error the
        pages come back (unless the sender owns them) and the client is told, then the error is raised."""
        t = req.prompt.shape[0]
        if req.sink.cancelled():  # nobody would pull the KV: offer nothing, the pages come back now
            self.cache.release(alloc)
            req.sink.fail(Cancelled("the request was cancelled before its hand-off"))
            return
        offered = False
        try:
            self.cache.commit(alloc, req.prompt)
            eos = self.decoder.cfg.eos_token_id
            ends_now = req.max_new_rows <= 1 or self.rows.ends(first, req.sampling, eos)
            ticket = None
            if not ends_now:
                ticket = self.sender.offer(
                    t,
                    lambda out: self.pool.gather(slots, out),
                    self.settings.transfer.ticket_ttl_s,
                    rows=(self.pool.kv, slots),
                )
                self._open[ticket.transfer_id] = alloc
                offered = True
            req.timings.mark("ticket")
            req.sink.send(
                Handoff(
                    ticket=ticket,
                    prompt_len=t,
                    first_row=tuple(int(x) for x in first),
                    sampling=req.sampling,
                    max_new_rows=req.max_new_rows,
                    timings=req.timings.as_dict(),
                )
            )
        except Exception as exc:
            if not offered:
                self.cache.release(alloc)
            with contextlib.suppress(Exception):
                req.sink.fail(StreamFailed(f"prefill hand-off failed: {type(exc).__name__}: {exc}"))
            raise
        if not offered:  # ended at row 0: nothing for D to pull
            self.cache.release(alloc)

    def _publish(self) -> None:
        m = self.metrics
        m.set("tandem_queued_requests", len(self.intake))
        m.set("tandem_free_pages", self.cache.available_pages)

    def _fault(self, reason: str) -> None:
        self.intake.fail_all(StreamFailed(reason))
