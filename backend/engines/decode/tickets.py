"""The tickets D holds but has not pulled, and telling P at once about the ones D sheds.

A handoff D sheds before it pulls (queue full, admission wait over, refused, malformed, cancelled
while queued, shutdown) would keep P's offered pages until the ticket TTL (docs/abuse.md); its end
tells P to drop the offer now (`TransferReceiver.drop`, docs/protocol.md). The TTL stays the backstop.

Each request with a ticket gets a `TicketClaim`: its sink (every call passes through) that settles
exactly once, `pulled()` (the receiver took the ticket) or shed (the first `fail` before that, or
`shed()`). The ledger counts, per transfer id, the open claims and whether one was pulled; when the
last settles, D drops the ticket only if none was pulled, so a replayed handoff that D sheds never
drops the offer its original pulls.

Threads: a claim opens on the reader thread (`DecodeEngine.submit`) and settles on whichever thread
ends its request before the pull; those hand-offs order it, so a claim needs no lock. The ledger has
its own lock, never held while calling the receiver (whose `drop` never blocks).
Failure: a refused `drop` is logged by the receiver; nothing here owns a stream's memory.
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
    """The sink of one request with a ticket D has not pulled yet."""

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
