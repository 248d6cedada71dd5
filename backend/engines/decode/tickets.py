"""The tickets D holds but has not pulled, and telling P at once about the ones D sheds.

Why: P holds a prompt's pages offered from its hand-off until a D pulls them or the offer's TTL
(`tandem.transfer.ticket_ttl_s`, 30 s checked in) passes. A handoff D sheds before it pulls (queue
full, admission wait over, a ticket refused, a malformed handoff, the client cancelled while queued,
shutdown) would otherwise keep them that long (docs/abuse.md). So each such request's end tells P
to drop the offer now (`TransferReceiver.drop`: a DROP frame, docs/protocol.md); the TTL stays the
backstop when D cannot reach P.

Each request that carries a ticket gets a `TicketClaim`: it is the request's sink (it passes every
call through to the client's sink) and it settles exactly once, either `pulled()` (the admission
thread's `receiver.request` took the ticket: its transfer ends by the transfer's own rules) or shed
(the first `fail` before that, or `shed()` when `submit` refuses the request). The ledger counts,
per transfer id, the claims still open and whether any was pulled; when the last one settles, D
drops the ticket only if none of them was pulled. So a replayed handoff (a second request with the
same ticket) that D sheds never drops the offer its original is about to pull, or has pulled, and
within one D no release can free pages another stream's transfer depends on. (P checks again:
it drops only an offer of its own instance that nobody has pulled.)

Threads: a claim is opened on the worker's reader thread (`DecodeEngine.submit`) and settled on the
thread that ends its request's life before the pull: the reader thread (submit refused), the
admission thread (pulled, expired, cancelled, refused at admission; close), or the engine thread
(a ticket the receiver refused, failed with the stream). Its own settling and the client's sink
calls are ordered by the hand-offs between those threads (the intake's queue, `Admitted`'s queue),
so a claim needs no lock; the ledger's counts are under the ledger's own lock, never held while
calling the receiver, whose `drop` never blocks (the maintenance thread sends the frame).
Failure: `drop` refusing (a ticket of another unit, closed receiver) is logged by the receiver;
nothing here owns memory of a stream, and the client's error has already been sent.
"""

from __future__ import annotations

import threading

from tandem.backend.engines.stream import Chunk, ChunkSink
from tandem.backend.errors import TandemError
from tandem.transfer import Ticket, TransferReceiver


class UnpulledTickets:
    """The ledger: open claims per transfer id, and whether one of them was pulled."""

    def __init__(self, receiver: TransferReceiver) -> None:
        self._receiver = receiver
        self._lock = threading.Lock()
        self._open: dict[str, list[int]] = {}  # transfer id -> [open claims, pulled (0/1)]
        self.dropped = 0  # tickets handed to `receiver.drop` (it accepted them)

    def claim(self, sink: ChunkSink, ticket: Ticket) -> TicketClaim:
        """Reader thread, before the request can reach admission."""
        with self._lock:
            entry = self._open.setdefault(ticket.transfer_id, [0, 0])
            entry[0] += 1
        return TicketClaim(self, sink, ticket)

    def __len__(self) -> int:
        """Transfer ids with an open claim (any thread)."""
        with self._lock:
            return len(self._open)

    def settle(self, ticket: Ticket, pulled: bool) -> None:
        """One claim on `ticket` ended (`TicketClaim`): the last one drops it unless one was pulled."""
        with self._lock:
            entry = self._open[ticket.transfer_id]
            entry[0] -= 1
            entry[1] |= int(pulled)
            if entry[0] > 0:
                return
            del self._open[ticket.transfer_id]
            drop = not entry[1]
        if drop and self._receiver.drop(ticket):
            with self._lock:
                self.dropped += 1


class TicketClaim:
    """The sink of one request with a ticket D has not pulled yet (see the module docstring)."""

    def __init__(self, ledger: UnpulledTickets, sink: ChunkSink, ticket: Ticket) -> None:
        self._ledger = ledger
        self.sink = sink
        self.ticket = ticket
        self._settled = False

    def emit(self, chunk: Chunk) -> None:
        self.sink.emit(chunk)

    def fail(self, error: TandemError) -> None:
        """The client hears first; a request that ends before its pull then sheds its ticket."""
        try:
            self.sink.fail(error)
        finally:
            self.shed()

    def cancelled(self) -> bool:
        return self.sink.cancelled()

    def pulled(self) -> None:
        """Admission thread: the receiver took the ticket (its PULL is queued or on the wire)."""
        self._settle(True)

    def shed(self) -> None:
        """The request ends without a pull (no-op once settled)."""
        self._settle(False)

    def _settle(self, pulled: bool) -> None:
        if self._settled:
            return
        self._settled = True
        self._ledger.settle(self.ticket, pulled)
