"""D: receive a stream's KV from P, then decode it with everyone else.

A stream's journey through D:
    execute thread:   parse HANDOFF -> Intake (bounded)
    admission thread: admit (not draining; batch room; rate floor; pages for prompt + max_new_rows)
                      -> receiver.request(ticket, deadline): region + PULL    [WAITING_KV]
    engine thread:    (while the device runs the current step, see `_iterate`)
                      poll: VERIFIED -> scatter into pages -> batch            [RUNNING]
                            FAILED   -> the client gets an error now; pages freed (below)
                      -> decode steps, chunks out, pages freed at the end

Admission has its own thread so that a handoff's pages are reserved and its PULL is on the wire
within about a millisecond, not after the running step: the copy then overlaps the step. The pool's
allocate/free and the membership counts are shared under `_admit_lock`; everything else (batch,
waiting transfers, metrics, client errors) stays on the engine thread.

Two ways the KV arrives (`tandem.transfer.direct_write`, docs/transfer.md):
    direct (default where the path can): the receiver's arena *is* this pool; P writes the prompt's
        rows straight into the stream's pages (PULL_ROWS) and D verifies them in place: no scatter.
    region: P copies into a receive region of the receiver's arena; D scatters it into the pages.

Ownership: D's pages belong to the stream from admission. In region mode P writes only the receive
region (owned and quarantined by the receiver until proof), never D's pages, so a failed stream's
pages return at once. In direct mode P writes the stream's prompt pages: a failed stream's other
pages return at once, its prompt pages (`Stream.held_pages`) only when the receiver calls back with
proof that no byte can still land. D drains (admits nothing) while quarantined memory exceeds
`drain_held_fraction` of the arena (direct: of the pool), and resumes when proofs release it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from tandem.backend import calibration
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
from tandem.backend.errors import InvalidInput, PoolExhausted, StreamFailed
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
    dead: bool = False  # failed by an engine fault: complete the handle when terminal, never join


@dataclass
class _Admitted:
    """What the admission thread hands the engine thread for one admitted stream."""

    stream: Stream
    first_row: np.ndarray
    handle: TransferHandle | None  # None: nothing to transfer (the stream ended at row 0) or refused
    admission_ms: float
    slots: np.ndarray  # the stream's slot table, on the host (the engine moves it to the device)
    error: str | None = None  # the receiver refused the ticket: the engine fails the stream


class DecodeEngine:
    def __init__(self, decoder: Decoder, settings: EngineSettings, metrics: MetricsSink) -> None:
        self.decoder = decoder
        self.settings = settings
        self.metrics = metrics
        self._publish_timer = PublishTimer()
        t = settings.transfer
        layout = wire_layout(decoder)
        self.path = transfer_path(settings, layout)
        self.direct = bool(
            t.direct_write and self.path.direct_write and self.path.arena_device == decoder.device.type
        )
        pool_slots = settings.pool.num_pages * settings.pool.page_size
        self.receiver = TransferReceiver(
            layout,
            t.unit,
            pool_slots * layout.token_bytes if self.direct else t.arena_mb * 2**20,
            self.path,
            abort_retry_s=t.abort_retry_s,
            probe_interval_s=t.probe_interval_s,
            on_event=self._on_transfer_event,
            secret=control_secret(settings),
            direct=self.direct,
        )
        storage = self.receiver.pool_view() if self.direct else None
        self.pool = make_pool(decoder, settings, storage)
        self.batch = make_batch(decoder, self.pool, settings, metrics)
        self.intake = make_intake(settings, DecodeRequest)
        self._events: list[TransferEvent] = []
        self._waiting: list[_Waiting] = []
        # Admission runs on its own thread (`_admit_loop`), so a handoff's pages are reserved and its
        # PULL sent within about a millisecond, whatever the engine thread is doing. Shared with it,
        # under `_admit_lock`: the pool's allocate/free, `_members` (streams admitted and not yet
        # gone: queued to the engine, waiting for KV or running) and `_admitted_ctx` (prompt tokens
        # of members not yet in the batch). `_running_ctx` is the engine's last snapshot of the
        # batch's context. Admitted streams reach the engine through `_admitted`.
        self._admit_lock = threading.Lock()
        self._members = 0
        self._admitted_ctx = 0
        self._running_ctx = 0
        self._admitted: queue.SimpleQueue[_Admitted] = queue.SimpleQueue()
        self._rate_holding = False  # the rate floor is holding newcomers (logged once per hold)
        self._capacity = threading.Event()  # set when pages or batch room come back
        self._stop_admission = threading.Event()
        self._closed = False
        self._admission = threading.Thread(target=self._admit_loop, name="tandem-decode-admit", daemon=True)
        self._scattering: list[tuple[torch.cuda.Event, TransferHandle]] = []
        self.step_model = StepTimeModel()
        self._verified = {"ok": 0, "mismatch": 0}
        self._late_dropped = 0
        self._released = dict.fromkeys(_PROOFS, 0)
        self._busy_published = 0.0
        self._thread = EngineThread("tandem-decode", self._iterate, self._fault)
        metrics.set("tandem_transfer_path_info", 1, path=self.path.name)

    def start(self) -> None:
        self._calibrate()
        self._thread.start()
        self._admission.start()
        log.info(
            "decode: transfer path %s (%s), pool %d pages of %d",
            self.path.name,
            "P writes the pool directly" if self.direct else "receive region + scatter",
            self.pool.num_pages,
            self.pool.page_size,
        )

    def _calibrate(self) -> None:
        """Before the first admission: seed the rate-floor model with timed steps of this loop
        (`backend/calibration.py`), so the first burst is admitted by measured step times."""
        b = self.settings.batch
        if not (b.rate_admission and b.calibrate_steps > 0):
            return
        page = self.pool.page_size
        plan = calibration.points(
            b.max_batch, b.calibrate_context, self.pool.num_free_pages * page, b.calibrate_steps, page
        )
        if not plan:
            log.warning("decode: the pool holds too few pages to time a step; the step model learns live")
            return
        t0 = time.perf_counter()
        free = self.pool.num_free_pages
        try:
            steps = calibration.time_steps(self.batch, plan, b.calibrate_steps)
        except Exception:
            if self.pool.num_free_pages != free or len(self.batch):
                raise  # the pool is not as it was: refuse to start rather than serve on it
            log.exception("decode: start-up calibration failed; the step model learns from live steps")
            return
        self.step_model.seed([(f.batch, f.context, f.seconds) for f in steps])
        top = plan[-1]
        log.info(
            "decode: step-time model seeded from %d timed steps (%s) in %.1f s: predicted step %.1f ms "
            "at %d streams of %d tokens (budget %.1f ms)",
            len(steps),
            ", ".join(f"{p.batch}x{p.context}" for p in plan),
            time.perf_counter() - t0,
            self.step_model.predict(top.batch, top.batch * top.context) * 1e3,
            top.batch,
            top.context,
            (1.0 - b.rate_margin) / b.rate_floor_tok_s * 1e3,
        )

    def close(self) -> None:
        """Stop admitting, stop the loop, tell every client still here, then close the receiver.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_admission.set()
        if self._admission.ident is not None:  # started (a start that failed never got there)
            self._admission.join(10.0)
        self._thread.stop()
        try:
            if self._admission.is_alive() or self._thread.alive:
                log.error("decode: a thread did not stop within 10 s; its streams are left to the receiver")
            else:
                for step in (
                    lambda: self._fault("decode is shutting down"),
                    lambda: self.intake.fail_all(StreamFailed("decode is shutting down")),
                    lambda: self._complete_scattered(wait=True),
                ):
                    try:
                        step()
                    except Exception:
                        log.exception("decode: shutdown step failed")
        finally:
            self.receiver.close()

    def loop_age_s(self) -> float:
        """Seconds the engine loop has been inside its current iteration (the worker's heartbeat)."""
        return self._thread.age_s()

    def submit(self, req: DecodeRequest) -> None:
        """Execute thread. A handoff that does not fit this decoder is refused here (InvalidInput),
        before it can reach the batch and fault every other stream."""
        row, cfg = req.handoff.first_row, self.decoder.cfg
        if len(row) != cfg.row_width or not all(0 <= x < cfg.vocab_size for x in row):
            raise InvalidInput(
                f"malformed handoff: first row {list(row)[:8]} is not "
                f"{cfg.row_width} ids below {cfg.vocab_size}"
            )
        if req.handoff.prompt_len + req.handoff.max_new_rows > self.pool.num_pages * self.pool.page_size:
            raise InvalidInput("malformed handoff: prompt_len + max_new_rows exceed D's whole pool")
        self.intake.submit(req)

    # ---- loop --------------------------------------------------------------------------------------

    def _iterate(self) -> None:
        """One step, with D's host work overlapped: `advance` queues the next step (from the device's
        own rows, `backend/batch.py`) and only then waits for the one before it; D then takes the
        streams admitted meanwhile (admission thread) and polls transfers — verified streams join
        the step queued next — while the device runs the queued step."""
        finished = self.batch.advance()
        if finished is not None:
            self.step_model.observe(finished.batch, finished.context, finished.seconds)
        # The queued step's streams are the whole batch now; those joining below add their context.
        self._running_ctx = self.batch.queued_context
        idle = not self.batch.in_flight and not self._waiting
        self._take_admitted(block_s=0.02 if idle else 0.0)  # idle: sleep until a stream is handed over
        self._poll_transfers()
        if not self.batch.in_flight and self._waiting:
            time.sleep(0.001)  # only transfers in flight: poll them, do not spin
        if self._publish_timer.due():
            self._publish()

    # ---- admission (its own thread) -----------------------------------------------------------------

    def _admit_loop(self) -> None:
        """Admission thread: waits for handoffs and admits them in arrival order (bounded wait, then
        UNAVAILABLE, in `Intake`). A request that does not fit waits for `_capacity` (pages or batch
        room back) or 5 ms, whichever comes first, then is offered again."""
        while not self._stop_admission.is_set():
            try:
                waiting = len(self.intake) > 0
                self.intake.pull(0.0 if waiting else 0.05)
                for _ in self.intake.admit(self._admit):
                    pass
                if len(self.intake):
                    self._capacity.wait(0.005)
                    self._capacity.clear()
            except Exception:  # a bug here must not silently stop admission: log, fail the queue
                log.exception("decode admission failed")
                self.intake.fail_all(StreamFailed("decode admission failed (see the server log)"))

    def _admit(self, req: DecodeRequest) -> bool:
        """Admission thread: reserve the stream's pages and send its PULL, or return False (no room)."""
        h = req.handoff
        b = self.settings.batch
        if self._is_draining():
            return False  # draining: quarantined memory must come back first
        capacity = h.prompt_len + h.max_new_rows
        with self._admit_lock:
            n = self._members
            if n >= b.max_batch:
                return False
            context = self._running_ctx + self._admitted_ctx
            if b.rate_admission and not self.step_model.admits(
                n, context, h.prompt_len, b.rate_floor_tok_s, b.rate_margin
            ):
                self._note_rate_hold(n, context + h.prompt_len)
                return False
            self._rate_holding = False
            try:
                pages = self.pool.allocate(self.pool.pages_for(capacity))
            except PoolExhausted:
                return False
            except ValueError as exc:  # sizes submit() did not catch: this request only
                req.sink.fail(StreamFailed(f"decode admission refused: {exc}"))
                return True
            self._members += 1
            self._admitted_ctx += h.prompt_len
        stream = Stream(
            stream_id=req.stream_id,
            prompt_len=h.prompt_len,
            sampling=h.sampling,
            max_new_rows=h.max_new_rows,
            sink=req.sink,
            timings=req.timings,
            eos_token_id=self.decoder.cfg.eos_token_id,
            pages=pages,
        )
        try:
            # Host work only on this thread (no torch call): each would wait for the GIL, and a device
            # copy for the running step; the engine thread puts the slot table on the device.
            slots = self.pool.slot_array(pages, capacity)
            req.timings.mark("d_admit")
            admitted = _Admitted(
                stream, h.first_row_array(), None, (time.monotonic() - req.received_s) * 1e3, slots
            )
            if h.ticket is not None:
                try:
                    deadline = self.settings.transfer.deadline_s
                    if self.direct:  # P writes the prompt's slots; they come back with proof
                        back = functools.partial(self._return_held, stream)
                        admitted.handle = self.receiver.request(
                            h.ticket, deadline, slots[: h.prompt_len], back
                        )
                    else:
                        admitted.handle = self.receiver.request(h.ticket, deadline)
                except ArenaExhausted:
                    # No region free: give the pages back quietly (waking ourselves would spin) and
                    # let the request wait for regions, which come back on D's own time.
                    self._leave(stream, joined=False, wake=False)
                    return False
                except TransferError as exc:
                    admitted.error = f"KV transfer {h.ticket.transfer_id} refused: {exc}"
        except Exception as exc:  # a bug or a device error: this request fails, nothing leaks
            self._leave(stream, joined=False)
            log.exception("decode admission of stream %d failed", req.stream_id)
            req.sink.fail(StreamFailed(f"decode admission failed: {type(exc).__name__}: {exc}"))
            return True
        self._admitted.put(admitted)
        return True

    def _note_rate_hold(self, n: int, context: int) -> None:
        """Admission thread, under `_admit_lock`: the rate floor holds a newcomer. Logged once per
        hold (not per 5 ms retry) with the model's numbers, so a server log shows why streams wait."""
        if self._rate_holding:
            return
        self._rate_holding = True
        b = self.settings.batch
        coef = self.step_model.coef
        log.info(
            "decode: rate floor holds admission at %d streams, context %d: predicted step %.1f ms > "
            "budget %.1f ms (model a=%.2f ms, b=%.3f ms/stream, c=%.3g ms/token)",
            n + 1,
            context,
            self.step_model.predict(n + 1, context) * 1e3,
            (1.0 - b.rate_margin) / b.rate_floor_tok_s * 1e3,
            *(
                (float(coef[0]) * 1e3, float(coef[1]) * 1e3, float(coef[2]) * 1e3)
                if coef is not None
                else (0, 0, 0)
            ),
        )

    def _is_draining(self) -> bool:
        """Quarantined receive memory over `drain_held_fraction`: admit nothing until proofs free it.
        Any thread (the receiver takes its own lock)."""
        return self.receiver.held_fraction() > self.settings.transfer.drain_held_fraction

    def _leave(self, stream: Stream, joined: bool, wake: bool = True, hold: bool = False) -> None:
        """A member is gone (finished, failed or never started): its pages and batch room come back,
        once whoever calls. Any thread; `joined` says whether it had entered the batch; `wake` tells
        the admission thread that room came back. `hold` (direct mode, a transfer into its pages not
        yet proven over): the prompt's pages stay out (`held_pages`) until `_return_held`."""
        with self._admit_lock:
            if stream.left:
                return
            stream.left = True
            pages = stream.pages
            if hold:
                n = self.pool.pages_for(stream.prompt_len)
                stream.held_pages, pages = pages[:n], pages[n:]
            self.pool.free(pages)
            self._members -= 1
            if not joined:
                self._admitted_ctx -= stream.prompt_len
        if wake:
            self._capacity.set()

    def _return_held(self, stream: Stream) -> None:
        """Direct mode: the receiver's proof that no byte of a failed transfer can still land in these
        pages (its `on_dest_free`, any thread), or the engine after a verified transfer of a stream
        that had already failed. Once."""
        with self._admit_lock:
            pages, stream.held_pages = stream.held_pages, None
            if pages:
                self.pool.free(pages)
        if pages:
            self._capacity.set()

    def _join(self, stream: Stream, first_row: object) -> None:
        """Engine thread: a member with its prompt KV in the pool enters the batch (its context counts
        as running from now, not from the next launch's snapshot)."""
        with self._admit_lock:
            self._admitted_ctx -= stream.prompt_len
            self._running_ctx += stream.prompt_len + 1
        self.batch.add(stream, first_row, lambda s=stream: self._leave(s, joined=True))

    def _take_admitted(self, block_s: float = 0.0) -> None:
        """Engine thread: streams the admission thread admitted start waiting for their KV (or join
        at once, or fail)."""
        while True:
            try:
                a = self._admitted.get(timeout=block_s) if block_s > 0 else self._admitted.get_nowait()
            except queue.Empty:
                return
            block_s = 0.0
            self.metrics.observe("tandem_admission_seconds", a.admission_ms / 1e3)
            s = a.stream
            hold = False  # direct mode: a transfer still in flight may write the prompt's pages
            if a.error is None:
                try:  # ordered on the engine's stream before anything that reads it
                    s.slots = self.pool.slots_to_device(a.slots)
                except Exception as exc:  # a broken device: this stream fails, nothing of it leaks
                    log.exception("moving stream %d's slot table to the device failed", s.stream_id)
                    a.error = f"decode admission failed: {type(exc).__name__}: {exc}"
                    if a.handle is not None:  # its region returns once the transfer is terminal
                        self._waiting.append(_Waiting(s, a.handle, a.first_row, dead=True))
                        hold = self.direct
            if a.error is not None:
                self._leave(s, joined=False, hold=hold)
                self._fail(s, a.error)
            elif a.handle is None:
                self._join(s, a.first_row)
            else:
                s.status = StreamStatus.WAITING_KV
                self._waiting.append(_Waiting(s, a.handle, a.first_row))

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
        """Engine thread. Each entry leaves `_waiting` right when it is handled (before its side
        effects that cannot be undone), so an exception midway leaves `_waiting` exact for `_fault`.

        A verified transfer's stream gets its transfer stamps in waterfall order: `copy_start`,
        `copy_end` (P's, carried in DONE), `d_done` (D's reader thread received DONE),
        `d_checksummed` (the reader's checksum matched), then `verified`: this thread picked the
        stream up and queued the scatter into its pages (the scatter may still be running)."""
        self._complete_scattered()
        for w in list(self._waiting):
            state = self.receiver.poll(w.handle)
            if w.dead:  # its stream already failed (engine fault); its pages went back (direct: held)
                if state in (TransferState.VERIFIED, TransferState.FAILED):
                    self._waiting.remove(w)
                    self.receiver.complete(w.handle)  # FAILED, direct: the receiver returns them
                    if state is TransferState.VERIFIED:
                        self._return_held(w.stream)
                continue
            if state is TransferState.VERIFIED:
                s = w.stream
                assert s.slots is not None
                if not self.direct:
                    kv = w.handle.tensor()
                    self.pool.scatter(s.slots[: s.prompt_len], kv.to(self.pool.device, non_blocking=False))
                self._waiting.remove(w)
                try:
                    if self.direct:  # the rows are in our pages already: nothing of the arena to return
                        self.receiver.complete(w.handle)
                    else:
                        self._release_after_scatter(w.handle)
                    stamps = w.handle.stamps
                    for stage, at in (
                        ("copy_start", stamps.copy_start_ns),  # P's clock, carried in DONE
                        ("copy_end", stamps.copy_end_ns),
                        ("d_done", stamps.done_received_ns),  # D's reader thread got DONE
                        ("d_checksummed", stamps.verified_ns),  # D's reader thread: checksum matched
                    ):
                        if at:
                            s.timings.mark(stage, at)
                    s.timings.mark("verified")  # this thread picked it up; the scatter is queued
                    self._join(s, w.first_row)
                except BaseException:
                    if not w.handle.engine_done and all(h is not w.handle for _, h in self._scattering):
                        with contextlib.suppress(Exception):  # the region goes back (it was verified)
                            self.receiver.complete(w.handle)
                    if s.status is not StreamStatus.RUNNING:  # never joined: nobody else owns it now
                        self._leave(s, joined=False)
                        self._fail(s, "decode engine fault while the stream's KV was joining")
                    raise
            elif state is TransferState.FAILED:
                self._waiting.remove(w)
                self._leave(w.stream, joined=False, hold=self.direct)  # before complete: it may call back
                self.receiver.complete(w.handle)
                self._fail(w.stream, f"KV transfer {w.handle.transfer_id} failed: {w.handle.error}")
            # else still crossing; a cancelled client is dropped by the batch once the KV is in
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
                        "tandem_transfer_latency_seconds", (e.verified_ns - e.request_sent_ns) / 1e9
                    )

    def _publish(self) -> None:
        m = self.metrics
        busy = self.batch.device_busy_s - self._busy_published
        if busy > 0:  # a counter, published with the gauges (each update is a round trip to Triton)
            m.inc("tandem_device_busy_seconds_total", busy)
            self._busy_published += busy
        st = self.receiver.stats()
        page_bytes = self.pool.layout.token_bytes * self.pool.page_size
        with self._admit_lock:
            n, context = self._members, self._running_ctx + self._admitted_ctx
        m.set("tandem_decode_eager", 1.0 if self.batch.graphs_failed else 0.0)
        m.set("tandem_inflight_streams", n)
        m.set("tandem_queued_requests", len(self.intake))
        m.set("tandem_free_pages", self.pool.num_free_pages)
        m.set("tandem_held_pages", -(-st.quarantined_bytes // page_bytes))
        draining = self._is_draining()
        m.set("tandem_draining", 1.0 if draining else 0.0)
        b = self.settings.batch
        typical = context // n if n else 1024
        free_streams = (
            self.step_model.admittable(n, context, typical, b.rate_floor_tok_s, b.rate_margin, b.max_batch)
            if b.rate_admission
            else max(0, b.max_batch - n)
        )
        m.set("tandem_admittable_streams", 0 if draining else free_streams)
        m.set("tandem_transfer_path_info", 1, path=self.path.name)

    def _fault(self, reason: str) -> None:
        """Engine thread, after an iteration raised: every stream it owns fails now, their pages come
        back; their transfers stay with the receiver (regions released only with proof) and their
        handles are completed when terminal. The queue is left to the admission thread.

        On a GPU a launched step may still be writing its streams' pages: wait for it before they
        return, or the admission thread could hand them to a transfer that P writes (direct mode,
        ordered on nothing of ours) before the step's last write lands."""
        if self.pool.device.type == "cuda":
            try:
                torch.cuda.current_stream(self.pool.device).synchronize()
            except Exception:  # a broken device: nothing of ours can still write either
                log.exception("decode: waiting for the device after a fault failed")
        self.batch.fail_all(reason)
        self._take_admitted()
        for w in self._waiting:
            if not w.dead:
                w.dead = True
                self._leave(w.stream, joined=False, hold=self.direct)
                try:
                    self._fail(w.stream, reason)
                except Exception:  # one client's broken sink must not keep the others uninformed
                    log.exception("could not fail stream %d", w.stream.stream_id)
