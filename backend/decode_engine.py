"""D: receive a stream's KV from P, then decode it with everyone else.

A stream's journey through D:
    execute thread: parse HANDOFF -> Intake (bounded)
    engine thread:  (while the device runs the current step, see `_iterate`)
                    admit (not draining; pages for prompt + max_new_rows; receive region)
                    -> receiver.request(ticket, deadline)              [WAITING_KV]
                    -> poll: VERIFIED -> scatter into pages -> batch   [RUNNING]
                             FAILED   -> the client gets an error now; pages freed (below)
                    -> decode steps, chunks out, pages freed at the end

Ownership: D's pages belong to the stream from admission. On the host path P writes only the
receive region (owned and quarantined by the transfer receiver until proof), never D's pages, so a
failed stream's pages return at once. D drains (admits nothing) while quarantined memory exceeds
`drain_held_fraction` of the receive arena, and resumes when proofs release it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tandem.backend.decoder import Decoder
from tandem.backend.engine_parts import (
    control_secret,
    make_batch,
    make_intake,
    make_pool,
    transfer_path,
    wire_layout,
)
from tandem.backend.engine_thread import EngineThread
from tandem.backend.errors import PoolExhausted, StreamFailed
from tandem.backend.handoff import Handoff
from tandem.backend.metrics import MetricsSink, PublishTimer
from tandem.backend.settings import EngineSettings
from tandem.backend.step_model import StepTimeModel
from tandem.backend.stream import ChunkSink, Stream, StreamStatus
from tandem.backend.timing import Timings
from tandem.transfer import (
    ArenaExhausted,
    TransferError,
    TransferEvent,
    TransferHandle,
    TransferReceiver,
    TransferState,
)

log = logging.getLogger("tandem")


# ReceiverStats field -> `proof` label of tandem_kv_regions_released_total (docs/failure-semantics.md).
_PROOFS = {
    "released_by_ack": "abort_ack",
    "released_by_done": "done",
    "released_by_refusal": "refused",
    "released_by_restart": "instance_changed",
    "released_by_gone": "instance_gone",
    "released_by_drop": "receiver_drops",
}


@dataclass
class DecodeRequest:
    stream_id: int
    handoff: Handoff
    sink: ChunkSink
    timings: Timings
    received_s: float = 0.0


@dataclass
class _Waiting:
    stream: Stream
    handle: TransferHandle
    first_row: object


class DecodeEngine:
    def __init__(self, decoder: Decoder, settings: EngineSettings, metrics: MetricsSink) -> None:
        self.decoder = decoder
        self.settings = settings
        self.metrics = metrics
        self._publish_timer = PublishTimer()
        self.pool = make_pool(decoder, settings)
        self.batch = make_batch(decoder, self.pool, settings, metrics)
        self.intake = make_intake(settings, DecodeRequest)
        t = settings.transfer
        self.path = transfer_path(settings)
        self.receiver = TransferReceiver(
            wire_layout(decoder),
            t.unit,
            t.arena_mb * 2**20,
            self.path,
            abort_retry_s=t.abort_retry_s,
            probe_interval_s=t.probe_interval_s,
            on_event=self._on_transfer_event,
            secret=control_secret(settings),
        )
        self._events: list[TransferEvent] = []
        self._waiting: list[_Waiting] = []
        self._scattering: list[tuple[torch.cuda.Event, TransferHandle]] = []
        self._draining = False
        self.step_model = StepTimeModel()
        self._verified = {"ok": 0, "mismatch": 0}
        self._late_dropped = 0
        self._released = dict.fromkeys(_PROOFS, 0)
        self._thread = EngineThread("tandem-decode", self._iterate, self._fault)
        metrics.set("tandem_transfer_path", 1, path=self.path.name)

    def start(self) -> None:
        self._thread.start()
        log.info(
            "decode: transfer path %s, pool %d pages of %d",
            self.path.name,
            self.pool.num_pages,
            self.pool.page_size,
        )

    def close(self) -> None:
        self._thread.stop()
        self._complete_scattered(wait=True)
        self.receiver.close()

    def submit(self, req: DecodeRequest) -> None:
        self.intake.submit(req)

    # ---- loop --------------------------------------------------------------------------------------

    def _iterate(self) -> None:
        """One step, with D's host work overlapped: verified streams join first, then the step is
        queued on the device, and while it runs D admits new streams (pages reserved, PULL sent),
        polls transfers and queues scatters; `finish` is the one wait for the device."""
        self._poll_transfers()
        launched = self.batch.launch()
        self.intake.pull(0.0 if launched is not None else (0.001 if self._waiting else 0.02))
        self._draining = self.receiver.held_fraction() > self.settings.transfer.drain_held_fraction
        for _ in self.intake.admit(self._admit):
            pass
        self._poll_transfers()
        if launched is not None:
            context = sum(s.position + 1 for s in launched.streams)  # positions move in finish()
            elapsed = self.batch.finish(launched)
            self.step_model.observe(len(launched.streams), context, elapsed)
        if self._publish_timer.due():
            self._publish()

    def _context(self) -> int:
        """Total context tokens the next steps attend over (waiting streams count at their prompt)."""
        total = sum(s.position + 1 for s in self.batch.streams)
        return total + sum(w.stream.prompt_len for w in self._waiting)

    def _admit(self, req: DecodeRequest) -> bool:
        if self._draining or len(self.batch) + len(self._waiting) >= self.settings.batch.max_batch:
            return False
        h = req.handoff
        b = self.settings.batch
        if b.rate_admission and not self.step_model.admits(
            len(self.batch) + len(self._waiting),
            self._context(),
            h.prompt_len,
            b.rate_floor_tok_s,
            b.rate_margin,
        ):
            return False
        capacity = h.prompt_len + h.max_new_rows
        try:
            pages = self.pool.allocate(self.pool.pages_for(capacity))
        except PoolExhausted:
            return False
        stream = Stream(
            stream_id=req.stream_id,
            prompt_len=h.prompt_len,
            sampling=h.sampling,
            max_new_rows=h.max_new_rows,
            sink=req.sink,
            timings=req.timings,
            eos_token_id=self.decoder.cfg.eos_token_id,
            pages=pages,
            slots=self.pool.slots(pages, capacity),
        )
        req.timings.mark("d_admit")
        self.metrics.observe("tandem_admission_ms", (time.monotonic() - req.received_s) * 1e3)
        if h.ticket is None:  # the stream ended at its first row; nothing to transfer
            self.batch.add(stream, h.first_row_array(), lambda: self.pool.free(pages))
            return True
        try:
            handle = self.receiver.request(h.ticket, self.settings.transfer.deadline_s)
        except ArenaExhausted:
            self.pool.free(pages)
            return False
        except TransferError as exc:
            self.pool.free(pages)
            self._fail(stream, f"KV transfer {h.ticket.transfer_id} refused: {exc}")
            return True
        stream.status = StreamStatus.WAITING_KV
        self._waiting.append(_Waiting(stream, handle, h.first_row_array()))
        return True

    def _release_after_scatter(self, handle: TransferHandle) -> None:
        """Give a verified region back to the receiver only once the scatter has read it.

        On a GPU the scatter is queued on the engine's stream (behind the running step), while P's
        next copy into a reused region is ordered on nothing of ours: completing at once could let
        that copy land before the scatter read the bytes. So a CUDA scatter records an event and the
        region returns when it has passed (checked every iteration). A CPU scatter has already run.
        """
        if self.pool.device.type != "cuda":
            self.receiver.complete(handle)
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.pool.device))
        self._scattering.append((event, handle))

    def _complete_scattered(self, wait: bool = False) -> None:
        still = []
        for event, handle in self._scattering:
            if wait:
                event.synchronize()
            if event.query():
                self.receiver.complete(handle)
            else:
                still.append((event, handle))
        self._scattering = still

    def _poll_transfers(self) -> None:
        self._complete_scattered()
        still: list[_Waiting] = []
        for w in self._waiting:
            state = self.receiver.poll(w.handle)
            if state is TransferState.VERIFIED:
                s = w.stream
                kv = w.handle.tensor()
                assert s.slots is not None
                self.pool.scatter(s.slots[: s.prompt_len], kv.to(self.pool.device, non_blocking=False))
                self._release_after_scatter(w.handle)
                stamps = w.handle.stamps
                for stage, at in (("copy_start", stamps.copy_start_ns), ("copy_end", stamps.copy_end_ns)):
                    if at:
                        s.timings.mark(stage, at)
                s.timings.mark("verified")
                self.batch.add(s, w.first_row, lambda pages=s.pages: self.pool.free(pages))
            elif state is TransferState.FAILED:
                self.receiver.complete(w.handle)
                self.pool.free(w.stream.pages)
                self._fail(w.stream, f"KV transfer {w.handle.transfer_id} failed: {w.handle.error}")
            else:  # still crossing; a cancelled client is dropped by the batch once the KV is in
                still.append(w)
        self._waiting = still
        self._account_events()

    def _fail(self, stream: Stream, reason: str) -> None:
        stream.status = StreamStatus.FAILED
        self.metrics.inc("tandem_streams_total", outcome="failed")
        stream.sink.fail(StreamFailed(reason))

    # ---- metrics -----------------------------------------------------------------------------------

    def _on_transfer_event(self, event: TransferEvent) -> None:
        self._events.append(event)  # list.append is atomic; drained on the engine thread

    def _account_events(self) -> None:
        """Counters are published as events happen (gauges only every ~0.1 s, in `_publish`)."""
        st = self.receiver.stats()
        for result, total in (("ok", st.verify_ok), ("mismatch", st.verify_mismatch)):
            delta = total - self._verified[result]
            if delta:
                self.metrics.inc("tandem_kv_verifications_total", delta, result=result)
                self._verified[result] = total
        for field, proof in _PROOFS.items():
            delta = getattr(st, field) - self._released[field]
            if delta:
                self.metrics.inc("tandem_kv_regions_released_total", delta, proof=proof)
                self._released[field] = getattr(st, field)
        late = st.late_chunks_dropped - self._late_dropped
        if late > 0:
            self.metrics.inc("tandem_kv_late_chunks_dropped_total", late)
            self._late_dropped = st.late_chunks_dropped
        while self._events:
            e = self._events.pop(0)
            ok = e.state in ("VERIFIED", "RELEASED")
            self.metrics.inc("tandem_transfers_total", outcome="ok" if ok else "failed")
            if ok:
                self.metrics.observe("tandem_transfer_bytes", e.nbytes)
                if e.verified_ns and e.request_sent_ns:
                    self.metrics.observe(
                        "tandem_transfer_latency_ms", (e.verified_ns - e.request_sent_ns) / 1e6
                    )

    def _publish(self) -> None:
        m = self.metrics
        st = self.receiver.stats()
        page_bytes = self.pool.layout.token_bytes * self.pool.page_size
        m.set("tandem_inflight_streams", len(self.batch) + len(self._waiting))
        m.set("tandem_queued_requests", len(self.intake))
        m.set("tandem_free_pages", self.pool.num_free_pages)
        m.set("tandem_held_pages", -(-st.quarantined_bytes // page_bytes))
        m.set("tandem_draining", 1.0 if self._draining else 0.0)
        b = self.settings.batch
        n = len(self.batch) + len(self._waiting)
        typical = self._context() // n if n else 1024
        free_streams = (
            self.step_model.admittable(
                n, self._context(), typical, b.rate_floor_tok_s, b.rate_margin, b.max_batch
            )
            if b.rate_admission
            else max(0, b.max_batch - n)
        )
        m.set("tandem_admittable_streams", 0 if self._draining else free_streams)
        m.set("tandem_transfer_path", 1, path=self.path.name)

    def _fault(self, reason: str) -> None:
        self.batch.fail_all(reason)
        # Waiting transfers stay with the receiver: their regions are released only with proof.
        for w in self._waiting:
            self._fail(w.stream, reason)
        self.intake.fail_all(StreamFailed(reason))
