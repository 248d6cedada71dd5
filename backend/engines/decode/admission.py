"""D's admission thread (`DecodeAdmission`) and the one lock it shares with the engine (`Membership`).

The lock's contract and what crosses this thread: docs/architecture.md, "D's engine".

Admission has its own thread so that a handoff's pages are reserved and its PULL sent within about a
millisecond of its arrival, whatever the engine thread is doing. It makes no torch call (each would
wait for the GIL, a device copy also for the running step): the stream's slot table crosses to the
engine thread as a numpy array.

Ownership: a request (its sink) belongs to the intake until admitted, dropped, expired or failed
(each exactly once); with an `Admitted` the Stream and its pages pass to the engine thread.

Failure: a request `_admit` cannot place stays queued (False) and is offered again when capacity
comes back or after 5 ms, until the intake's admission wait sheds it (UNAVAILABLE). An error while
admitting one request fails that request only, with its pages back. A bug in the loop itself is
logged and fails the whole queue; the thread keeps running.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from tandem.backend.engines.decode.tickets import TicketClaim
from tandem.backend.engines.handoff import Handoff
from tandem.backend.engines.stream import ChunkSink, Stream
from tandem.backend.errors import StreamFailed
from tandem.backend.kv.pool import KVPool
from tandem.backend.scheduling.decode_policy import AdmissionPlan, Ahead, DecodePolicy, Members
from tandem.backend.scheduling.intake import Intake
from tandem.backend.settings import EngineSettings
from tandem.backend.timing import Timings
from tandem.transfer import ArenaExhausted, TransferError, TransferHandle, TransferReceiver

log = logging.getLogger("tandem")

__all__ = ["Admitted", "Ahead", "DecodeAdmission", "DecodeRequest", "Membership"]


@dataclass
class DecodeRequest:
    """A handoff as D's engine receives it (the worker parsed HANDOFF; `submit` checks it fits)."""

    stream_id: int
    handoff: Handoff
    sink: ChunkSink
    timings: Timings
    received_s: float = 0.0  # time.monotonic() at submit (the intake stamps it): the admission wait
    claim: TicketClaim | None = None  # with a ticket: `sink` is this claim until the ticket is pulled


@dataclass(frozen=True)
class Admitted:
    """What the admission thread hands the engine thread for one admitted stream (it owns it now)."""

    stream: Stream
    first_row: np.ndarray
    handle: TransferHandle | None  # None: nothing to transfer (the stream ended at row 0) or refused
    admission_ms: float
    slots: np.ndarray  # the stream's slot table, on the host (the engine moves it to the device)
    error: str | None = None  # the receiver refused the ticket: the engine fails the stream


class Membership:
    """D's members and the pool's free list under the one lock (docs/architecture.md, "D's engine")."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.members = 0
        self.admitted_ctx = 0
        self.running_ctx = 0  # the engine's last snapshot of the batch's context
        # The look-ahead's view: the running streams' (context, generated, limit), the engine's last
        # snapshot plus those joined since, and the admitted ones not yet joined: (prompt, limit) counts.
        self.running: list[tuple[int, int, int]] = []
        self.pending: collections.Counter[tuple[int, int]] = collections.Counter()
        self.capacity = threading.Event()  # set when pages or batch room come back

    def view(self) -> Members:
        """Under `lock` (the caller holds it): the snapshot D's policy plans over."""
        return Members(
            self.members, self.running_ctx + self.admitted_ctx, self.pool.num_free_pages, self._ahead()
        )

    def reserve(self, plan: AdmissionPlan, prompt_len: int, max_new_rows: int) -> list[int]:
        """Under `lock`, in the same hold as the `view` that `plan` admitted on: the caller's stream is
        a member holding `plan.pages` pages from now on."""
        assert plan.holds is None, "only an admitted plan reserves"
        pages = self.pool.allocate(plan.pages)
        self.members += 1
        self.admitted_ctx += prompt_len
        self.pending[(prompt_len, max_new_rows)] += 1
        return pages

    def _ahead(self) -> Ahead:
        """Under the lock: every member's (contexts, generated rows, limits)."""
        rows = self.running + [(p, 0, n) for (p, n), k in self.pending.items() for _ in range(k)]
        if not rows:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        table = np.array(rows, dtype=np.int64)
        return table[:, 0], table[:, 1], table[:, 2]

    def _unpend(self, stream: Stream) -> None:
        key = (stream.prompt_len, stream.max_new_rows)
        self.pending[key] -= 1
        if self.pending[key] <= 0:
            del self.pending[key]

    def leave(self, stream: Stream, joined: bool, wake: bool = True, hold: bool = False) -> None:
        """A member is gone (finished, failed or never started): its pages and batch room come back,
        once whoever calls. Any thread; `joined` says whether it had entered the batch; `wake` tells
        the admission thread that room came back. `hold` (direct mode, a transfer into its pages not
        yet proven over): the prompt's pages stay out (`held_pages`) until `return_held`."""
        with self.lock:
            if stream.left:
                return
            stream.left = True
            pages = stream.pages
            if hold:
                n = self.pool.pages_for(stream.prompt_len)
                stream.held_pages, pages = pages[:n], pages[n:]
            self.pool.free(pages)
            self.members -= 1
            if not joined:
                self.admitted_ctx -= stream.prompt_len
                self._unpend(stream)
        if wake:
            self.capacity.set()

    def return_held(self, stream: Stream) -> None:
        """Direct mode: the receiver's proof that no byte of a failed transfer can still land in these
        pages (its `on_dest_free`, any thread), or the engine after a verified transfer of a stream
        that had already failed. Once."""
        with self.lock:
            pages, stream.held_pages = stream.held_pages, None
            if pages:
                self.pool.free(pages)
        if pages:
            self.capacity.set()

    def join(self, stream: Stream) -> None:
        """Engine thread: a member's prompt KV is in the pool and it enters the batch now; its context
        counts as running from now, not from the next launch's snapshot."""
        with self.lock:
            self.admitted_ctx -= stream.prompt_len
            self.running_ctx += stream.prompt_len + 1
            self._unpend(stream)
            self.running.append((stream.prompt_len + 1, 1, stream.max_new_rows))

    def set_running(self, context: int, streams: list[Stream] | None = None) -> None:
        """Engine thread, each iteration: the queued step's context is the whole batch's now, and
        `streams` (given) are the running members the look-ahead sees."""
        self.running_ctx = context
        if streams is not None:
            running = [(s.prompt_len + len(s.generated), len(s.generated), s.max_new_rows) for s in streams]
            with self.lock:
                self.running = running

    def snapshot(self) -> tuple[int, int]:
        """(members, context of running and admitted members); any thread."""
        with self.lock:
            return self.members, self.running_ctx + self.admitted_ctx


class DecodeAdmission:
    """The admission thread and its policy. `admitted` is read by the engine thread only."""

    def __init__(
        self,
        settings: EngineSettings,
        intake: Intake[DecodeRequest],
        members: Membership,
        receiver: TransferReceiver,
        policy: DecodePolicy,
        eos_token_id: int | None,
        direct: bool,
    ) -> None:
        self.settings = settings
        self.intake = intake
        self.members = members
        self.pool = members.pool
        self.receiver = receiver
        self.policy = policy
        self.eos_token_id = eos_token_id
        self.direct = direct
        self.admitted: queue.SimpleQueue[Admitted] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tandem-decode-admit", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop admitting; waits up to `timeout_s` for the thread if it ever started."""
        self._stop.set()
        if self._thread.ident is not None:  # started (a start that failed never got there)
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def draining(self) -> bool:
        """Admitting nothing until proofs free quarantined memory. Any thread (the receiver takes its
        own lock)."""
        return self.policy.draining(self.receiver.held_fraction())

    def _loop(self) -> None:
        """Waits for handoffs and admits them in arrival order (bounded wait, then UNAVAILABLE, in
        `Intake`). A request that does not fit waits for `capacity` (pages or batch room back) or
        5 ms, whichever comes first, then is offered again."""
        while not self._stop.is_set():
            try:
                waiting = len(self.intake) > 0
                self.intake.pull(0.0 if waiting else 0.05)
                now = time.monotonic()
                for req in self.intake.queued():  # in arrival order, up to the first that waits
                    if not self._admit(req):
                        break
                    self.intake.admitted(req)
                self.intake.expire(now)
                if len(self.intake):
                    self.members.capacity.wait(0.005)
                    self.members.capacity.clear()
            except Exception:  # a bug here must not silently stop admission: log, fail the queue
                log.exception("decode admission failed")
                self.intake.fail_all(StreamFailed("decode admission failed (see the server log)"))

    def _admit(self, req: DecodeRequest) -> bool:
        """The policy's plan for `req` and, if it admits, its pages reserved and its PULL sent; False
        when it waits (no room). True when it left the queue: admitted, or failed."""
        h = req.handoff
        capacity = h.prompt_len + h.max_new_rows
        draining = self.draining()  # the receiver's own lock: not under ours
        try:
            need = self.pool.pages_for(capacity)
        except ValueError as exc:  # sizes submit() did not catch: this request only
            req.sink.fail(StreamFailed(f"decode admission refused: {exc}"))
            return True
        with self.members.lock:  # one snapshot: the plan and the reservation see the same members
            plan = self.policy.plan(self.members.view(), h.prompt_len, h.max_new_rows, need, draining)
            pages = None if plan.holds else self.members.reserve(plan, h.prompt_len, h.max_new_rows)
        if pages is None:
            return False
        stream = Stream(
            stream_id=req.stream_id,
            prompt_len=h.prompt_len,
            sampling=h.sampling,
            max_new_rows=h.max_new_rows,
            sink=req.sink,
            timings=req.timings,
            eos_token_id=self.eos_token_id,
            pages=pages,
        )
        try:
            # Host work only on this thread (no torch call): each would wait for the GIL, and a device
            # copy for the running step; the engine thread puts the slot table on the device.
            slots = self.pool.slot_array(pages, capacity)
            req.timings.mark("d_admit")
            admission_ms = (time.monotonic() - req.received_s) * 1e3
            handle: TransferHandle | None = None
            error: str | None = None
            if h.ticket is not None:
                try:
                    deadline = self.settings.transfer.deadline_s
                    if self.direct:  # P writes the prompt's slots; they come back with proof
                        back = functools.partial(self.members.return_held, stream)
                        handle = self.receiver.request(h.ticket, deadline, slots[: h.prompt_len], back)
                    else:
                        handle = self.receiver.request(h.ticket, deadline)
                    if req.claim is not None:  # from now on the transfer's own rules end it
                        req.claim.pulled()
                except ArenaExhausted:
                    # No region free: give the pages back quietly (waking ourselves would spin) and
                    # let the request wait for regions, which come back on D's own time.
                    self.members.leave(stream, joined=False, wake=False)
                    return False
                except TransferError as exc:
                    error = f"KV transfer {h.ticket.transfer_id} refused: {exc}"
            admitted = Admitted(stream, h.first_row_array(), handle, admission_ms, slots, error)
        except Exception as exc:  # a bug or a device error: this request fails, nothing leaks
            self.members.leave(stream, joined=False)
            log.exception("decode admission of stream %d failed", req.stream_id)
            req.sink.fail(StreamFailed(f"decode admission failed: {type(exc).__name__}: {exc}"))
            return True
        self.admitted.put(admitted)
        return True
