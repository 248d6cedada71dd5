"""D: receive a stream's KV from P, then decode it with everyone else (the engine thread).

What crosses between D's threads, and the one lock they share: docs/architecture.md, "D's engine"
(the one written copy).

The KV arrives two ways (`tandem.transfer.direct_write`, docs/transfer.md): direct, P writes the
prompt's rows into the stream's pages (PULL_ROWS) and D verifies them in place; region, P copies
into a receive region of the receiver's arena and D scatters it into the pages.

Ownership: D's pages belong to the stream from admission. A failed stream's pages return at once,
except in direct mode its prompt pages (`Stream.held_pages`), which return only with the
receiver's proof that no byte can still land. D admits nothing while quarantined memory exceeds
`drain_held_fraction` of the arena (direct: of the pool).

Failure: an exception in an iteration is an engine fault (`backend/engine_shell.py`): `_fault`
fails every stream the engine thread owns (batch, waiting, just admitted), their pages come back
(prompt pages with proof), and the loop serves on. `close` tells every client still here, then
closes the receiver.
"""

from __future__ import annotations

import logging
import queue
import time

import numpy as np
import torch

from tandem.backend.engine_shell import EngineShell
from tandem.backend.engines.decode import calibration
from tandem.backend.engines.decode.admission import Admitted, DecodeAdmission, DecodeRequest, Membership
from tandem.backend.engines.decode.metrics import DecodeGauges, DecodeMetrics
from tandem.backend.engines.decode.tickets import UnpulledTickets
from tandem.backend.engines.decode.transfers import WaitingTransfers
from tandem.backend.engines.parts import (
    control_secret,
    make_batch,
    make_intake,
    make_pool,
    transfer_path,
    wire_layout,
)
from tandem.backend.engines.stream import Stream, StreamStatus
from tandem.backend.errors import StreamFailed
from tandem.backend.metrics import MetricsSink
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.row_step import RowStep
from tandem.backend.scheduling.decode_policy import DecodePolicy
from tandem.backend.scheduling.step_model import StepTimeModel
from tandem.backend.settings import EngineSettings
from tandem.backend.text.defaults import resolve_grammar
from tandem.transfer import TransferReceiver

__all__ = ["DecodeEngine", "DecodeRequest"]

log = logging.getLogger("tandem")


class DecodeEngine(EngineShell[DecodeRequest]):
    def __init__(
        self,
        decoder: Decoder,
        settings: EngineSettings,
        metrics: MetricsSink,
        row_step: RowStep | None = None,
    ) -> None:
        """`row_step`: the family's row maker over `decoder` (backend/model/row_step.py; None: a
        plain decoder's head and sampler)."""
        self.decoder = decoder
        self.settings = settings
        self.metrics = metrics
        t = settings.transfer
        layout = wire_layout(decoder)
        self.path = transfer_path(settings, layout)
        self.direct = bool(
            t.direct_write and self.path.direct_write and self.path.arena_device == decoder.device.type
        )
        self.stats = DecodeMetrics(metrics, self.path.name)
        pool_slots = settings.pool.num_pages * settings.pool.page_size
        self.receiver = TransferReceiver(
            layout,
            t.unit,
            pool_slots * layout.token_bytes if self.direct else t.arena_mb * 2**20,
            self.path,
            abort_retry_s=t.abort_retry_s,
            probe_interval_s=t.probe_interval_s,
            on_event=self.stats.on_transfer_event,
            secret=control_secret(settings),
            direct=self.direct,
        )
        storage = self.receiver.pool_view() if self.direct else None
        self.pool = make_pool(decoder, settings, storage)
        self.batch = make_batch(decoder, self.pool, settings, metrics, row_step=row_step)
        self.intake = make_intake(settings, DecodeRequest)
        self.step_model = StepTimeModel()
        self.tickets = UnpulledTickets(self.receiver)
        self.members = Membership(self.pool)
        self.admission = DecodeAdmission(
            settings,
            self.intake,
            self.members,
            self.receiver,
            DecodePolicy(settings.batch, settings.transfer.drain_held_fraction, self.step_model),
            decoder.cfg.eos_token_id,
            self.direct,
        )
        self.transfers = WaitingTransfers(self.receiver, self.members, self.direct, self._join, self._fail)
        super().__init__("tandem-decode", self.intake)

    def _prepare(self) -> None:
        self._calibrate()

    def _started(self) -> None:
        self.admission.start()
        log.info(
            "decode: transfer path %s (%s), pool %d pages of %d",
            self.path.name,
            "P writes the pool directly" if self.direct else "receive region + scatter",
            self.pool.num_pages,
            self.pool.page_size,
        )

    def _calibrate(self) -> None:
        """Before the first admission: seed the rate-floor model with timed steps of this loop
        (`backend/engines/decode/calibration.py`), so the first burst is admitted by measured step times."""
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
            grammar = resolve_grammar(self.settings, None)  # what P hands D's streams (settings alone)
            steps = calibration.time_steps(self.batch, plan, b.calibrate_steps, grammar=grammar)
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

    # `close` (the shell's): stop admitting, stop the loop, tell every client still here, then close
    # the receiver.

    def _stopping(self) -> None:
        self.admission.stop(10.0)

    def _stopped(self) -> None:
        try:
            if self.admission.alive or self.loop_alive:
                log.error("decode: a thread did not stop within 10 s; its streams are left to the receiver")
            else:
                for step in (
                    lambda: self._fault("decode is shutting down"),
                    lambda: self.intake.fail_all(StreamFailed("decode is shutting down")),
                    lambda: self.transfers.complete_scattered(wait=True),
                ):
                    try:
                        step()
                    except Exception:
                        log.exception("decode: shutdown step failed")
        finally:
            self.receiver.close()

    def submit(self, req: DecodeRequest) -> None:
        """Worker reader thread. A handoff that does not fit this decoder is refused here
        (InvalidInput), before it can reach the batch and fault every other stream; a full queue
        raises Overloaded (`Intake.submit`). The caller tells the client.

        A request with a ticket gets a claim as its sink (`backend/engines/decode/tickets.py`): a refusal
        here, and any end before its pull later, has D tell P to drop the offer at once."""
        ticket = req.handoff.ticket
        if ticket is not None:
            req.claim = self.tickets.claim(req.sink, ticket)
            req.sink = req.claim
        try:
            cfg = self.decoder.cfg
            req.handoff.check_fits(cfg, self.pool.num_pages * self.pool.page_size)
            self.intake.submit(req)
        except BaseException:
            if req.claim is not None:
                req.claim.shed()
            raise

    # ---- the loop (engine thread) --------------------------------------------------------------------

    def _iterate(self) -> None:
        """One step, with D's host work overlapped: `advance` queues the next step (from the device's
        own rows, `backend/engines/batch.py`) and only then waits for the one before it; D then takes the
        streams admitted meanwhile (admission thread) and polls transfers — verified streams join
        the step queued next — while the device runs the queued step."""
        finished = self.batch.advance()
        if finished is not None:
            self.step_model.observe(finished.batch, finished.context, finished.seconds)
        # The queued step's streams are the whole batch now; those joining below add their context.
        look_ahead = self.settings.batch.rate_admission
        self.members.set_running(self.batch.queued_context, self.batch.streams if look_ahead else None)
        idle = not self.batch.in_flight and not self.transfers.waiting
        self._take_admitted(block_s=0.02 if idle else 0.0)  # idle: sleep until a stream is handed over
        self.transfers.poll()
        self.stats.account(self.receiver.stats())
        if not self.batch.in_flight and self.transfers.waiting:
            time.sleep(0.001)  # only transfers in flight: poll them, do not spin
        if self.stats.due():
            self.stats.publish(self._gauges())

    def _release(self, stream: Stream) -> None:
        """A joined stream's pages come back; a finished one's length teaches admission's look-ahead."""
        if stream.status is StreamStatus.FINISHED:
            self.admission.policy.lengths.observe(len(stream.generated))
        self.members.leave(stream, joined=True)

    def _take_admitted(self, block_s: float = 0.0) -> None:
        """Streams the admission thread admitted start waiting for their KV (or join at once, or
        fail); `block_s` > 0 waits that long for the first."""
        while True:
            try:
                a: Admitted = (
                    self.admission.admitted.get(timeout=block_s)
                    if block_s > 0
                    else self.admission.admitted.get_nowait()
                )
            except queue.Empty:
                return
            block_s = 0.0
            self.metrics.observe("tandem_admission_seconds", a.admission_ms / 1e3)
            s, error = a.stream, a.error
            hold = False  # direct mode: a transfer still in flight may write the prompt's pages
            if error is None:
                try:  # ordered on the engine's stream before anything that reads it
                    s.slots = self.pool.slots_to_device(a.slots)
                except Exception as exc:  # a broken device: this stream fails, nothing of it leaks
                    log.exception("moving stream %d's slot table to the device failed", s.stream_id)
                    error = f"decode admission failed: {type(exc).__name__}: {exc}"
                    if a.handle is not None:  # its region returns once the transfer is terminal
                        self.transfers.wait_dead(s, a.handle, a.first_row)
                        hold = self.direct
            if error is not None:
                self.members.leave(s, joined=False, hold=hold)
                self._fail(s, error)
            elif a.handle is None:
                self._join(s, a.first_row)
            else:
                self.transfers.wait(s, a.handle, a.first_row)

    def _join(self, stream: Stream, first_row: np.ndarray) -> None:
        """A member with its prompt KV in the pool enters the batch; its pages come back when the
        batch releases it (no queued step can write them any more)."""
        self.members.join(stream)
        self.batch.add(stream, first_row, lambda s=stream: self._release(s))

    def _fail(self, stream: Stream, reason: str) -> None:
        stream.status = StreamStatus.FAILED
        self.metrics.inc("tandem_streams_total", outcome="failed")
        stream.sink.fail(StreamFailed(reason))

    def _gauges(self) -> DecodeGauges:
        st = self.receiver.stats()
        page_bytes = self.pool.layout.token_bytes * self.pool.page_size
        n, context = self.members.snapshot()
        draining = self.admission.draining()
        return DecodeGauges(
            device_busy_s=self.batch.device_busy_s,
            eager=self.batch.graphs_failed,
            inflight=n,
            queued=len(self.intake),
            free_pages=self.pool.num_free_pages,
            held_pages=-(-st.quarantined_bytes // page_bytes),
            draining=draining,
            admittable=0 if draining else self.admission.policy.admittable(n, context),
            path=self.path.name,
        )

    def _fault(self, reason: str) -> None:
        """After an iteration raised: every stream the engine thread owns fails now, their pages come
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
        self.transfers.fail_all(reason)
