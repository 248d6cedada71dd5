"""D's region lifecycle: the transfers and endpoints a receiver tracks, and every state change.

Who calls: `TransferReceiver` (the engine's threads) and `ReceiverLoop` (maintenance and reader
threads), always holding `lock`; callbacks and sends they decide go to an `Actions` list run after
the lock is released. Memory: a transfer's region (region mode: a range of the receive arena; direct
mode: its destination slots of D's pool) belongs to the transfer while IN_FLIGHT or QUARANTINED, to
the engine while READY, and comes back to the arena (`free`) only with a proof (`ReleaseReason`,
docs/protocol.md), never on time alone. Failure: `fail` is what the engine sees (`poll` -> FAILED);
reclamation of the region then follows its proof in the background.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ._actions import Actions
from ._endpoint import Endpoint
from .arena import RegionAllocator
from .errors import ChecksumMismatch, PeerRestarted, TransferError
from .frames import MsgType
from .handle import TransferHandle
from .paths.base import LocalArena, TransferPath
from .state import ReceiverStats, RegionState, ReleaseReason, Ticket, TransferEvent, TransferState

RELEASE_COUNTER = {
    ReleaseReason.ABORT_ACK: "released_by_ack",
    ReleaseReason.DONE: "released_by_done",
    ReleaseReason.REFUSED: "released_by_refusal",
    ReleaseReason.INSTANCE_CHANGED: "released_by_restart",
    ReleaseReason.INSTANCE_GONE: "released_by_gone",
    ReleaseReason.RECEIVER_DROPS: "released_by_drop",
}


class RegionBook:
    """Every field is read and written under `lock` only (methods: the caller holds it)."""

    def __init__(
        self,
        path: TransferPath,
        arena: LocalArena,
        alloc: RegionAllocator | None,
        capacity: int,
        kick: threading.Event,
        on_event: Callable[[TransferEvent], None] | None,
        on_quarantine_change: Callable[[str, bool], None] | None,
    ) -> None:
        """`alloc` None: direct mode (a transfer's region is its destination slots). `kick` wakes the
        maintenance thread (a quarantined region's ABORT goes out on its next tick)."""
        self.lock = threading.Lock()
        self.handles: dict[str, TransferHandle] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self.alloc = alloc
        self.capacity = capacity
        self._path = path
        self._arena = arena
        self._kick = kick
        self._on_event = on_event
        self._on_quarantine_change = on_quarantine_change
        self.counts = dict.fromkeys(
            (
                "transfers_ok",
                "transfers_failed",
                "verify_ok",
                "verify_mismatch",
                "bytes_moved",
                "aborts_sent",
                "drops_sent",
                "drops_refused",
                *RELEASE_COUNTER.values(),
            ),
            0,
        )

    def endpoint(self, ticket: Ticket) -> Endpoint:
        """The record of `ticket`'s endpoint, created on first use."""
        ep = self.endpoints.get(ticket.endpoint)
        if ep is None:
            ep = self.endpoints[ticket.endpoint] = Endpoint(ticket.endpoint, ticket.lock_path)
        return ep

    def dispatch(self, ep: Endpoint, handles: list[TransferHandle], actions: Actions) -> None:
        """Send PULLs on the ready connection, or fail handles whose ticket names another instance."""
        assert ep.conn is not None and ep.instance is not None
        conn, now = ep.conn, time.monotonic()
        for h in handles:
            if h.state is not TransferState.REQUESTED:
                continue
            if h.ticket.instance_id != ep.instance:
                self.fail(
                    h,
                    PeerRestarted(
                        f"P at {ep.path} is instance {ep.instance}, ticket names {h.ticket.instance_id}"
                    ),
                    actions,
                )
                continue
            self._arena.expect(h.region, h.transfer_id)  # receiver-written paths: chunks may land from now
            h.sent_instance, h.sent_gen = ep.instance, ep.gen  # from here on P may write the region
            h.stamps.request_sent_ns = time.time_ns()
            ep.handles.add(h)
            remaining_ms = max(0.0, (h.deadline - now) * 1000.0)
            if h.dest_runs is not None:
                where: dict[str, object] = {"dst": h.dest_runs}
                kind = MsgType.PULL_ROWS
            else:
                where, kind = {"offset": h.region.offset}, MsgType.PULL
            actions.append(
                conn.later(
                    kind, tid=h.transfer_id, nbytes=h.ticket.nbytes, remaining_ms=remaining_ms, **where
                )
            )

    def fail(
        self, h: TransferHandle, exc: TransferError, actions: Actions, proof: ReleaseReason | None = None
    ) -> None:
        """Engine-visible failure. With `proof` (or if the PULL never left, or the path's receiver
        writes every byte and drops what it no longer expects) the region is freed, otherwise
        quarantined until a proof arrives."""
        if h.state not in (TransferState.REQUESTED, TransferState.DONE):
            return
        h.state, h.error = TransferState.FAILED, exc
        self.counts["transfers_failed"] += 1
        if h.sent_instance is None:
            self.free(h, ReleaseReason.NEVER_SENT)
        elif proof is not None:
            self.free(h, proof)
        elif self._path.receiver_writes:
            self.free(h, ReleaseReason.RECEIVER_DROPS)  # `free` forgets first: no late chunk can land
        else:
            h.region_state, h.last_abort = RegionState.QUARANTINED, 0.0
            if self._on_quarantine_change is not None:
                cb = self._on_quarantine_change
                actions.append(lambda: cb(h.transfer_id, True))
            self._kick.set()  # ABORT goes out on the next tick
        self.emit(h, actions)

    def verified(self, h: TransferHandle, ours: str, theirs: str, actions: Actions) -> None:
        """The verifier's answer for a DONE: READY for the engine, or failed (DONE proves the copy over)."""
        if ours == theirs:
            h.state, h.region_state = TransferState.VERIFIED, RegionState.READY
            h.stamps.verified_ns = time.time_ns()
            for key, n in (("verify_ok", 1), ("transfers_ok", 1), ("bytes_moved", h.ticket.nbytes)):
                self.counts[key] += n
            self._unlink(h)
            self.emit(h, actions)
        else:
            self.counts["verify_mismatch"] += 1
            self.fail(
                h,
                ChecksumMismatch(f"{h.transfer_id}: P sent {theirs}, region hashes to {ours}"),
                actions,
                proof=ReleaseReason.DONE,
            )

    def release(self, h: TransferHandle, reason: ReleaseReason, actions: Actions) -> None:
        """A proof arrived for a quarantined region: free it."""
        if h.region_state is not RegionState.QUARANTINED:
            return
        self.free(h, reason)
        if self._on_quarantine_change is not None:
            cb = self._on_quarantine_change
            actions.append(lambda: cb(h.transfer_id, False))
        self.forget_if_done(h, actions)

    def free(self, h: TransferHandle, reason: ReleaseReason | None) -> None:
        self._arena.forget(h.region)  # receiver-written paths: returns once no chunk for it can land
        if self.alloc is not None:
            self.alloc.free(h.region)
        h.region_state, h.released_by = RegionState.FREE, reason
        if reason is not None and reason in RELEASE_COUNTER:
            self.counts[RELEASE_COUNTER[reason]] += 1
        self._unlink(h)

    def forget_if_done(self, h: TransferHandle, actions: Actions) -> None:
        """Drop a handle both the engine and the proofs are done with; direct mode: a failed transfer's
        slots go back to the engine now (exactly once)."""
        if h.engine_done and h.region_state is RegionState.FREE:
            self.handles.pop(h.transfer_id, None)
            cb, h.on_dest_free = h.on_dest_free, None
            if cb is not None and h.state is TransferState.FAILED:
                actions.append(cb)

    def emit(self, h: TransferHandle, actions: Actions) -> None:
        if self._on_event is not None:
            cb, event = self._on_event, h.event(self._path.name)
            actions.append(lambda: cb(event))

    def lost_instance(
        self, ep: Endpoint, reason: ReleaseReason, actions: Actions, keep: str | None = None
    ) -> None:
        """Proof that every P instance at `ep` other than `keep` is gone: fail and free its transfers."""
        for h in list(ep.handles):
            if h.sent_instance == keep:
                continue
            if h.state is TransferState.REQUESTED:
                self.fail(
                    h,
                    PeerRestarted(f"P instance {h.sent_instance} at {ep.path} is gone"),
                    actions,
                    proof=reason,
                )
            else:
                self.release(h, reason, actions)

    def held_fraction(self) -> float:
        """Quarantined bytes / arena bytes."""
        held = sum(
            h.region.alloc_bytes for h in self.handles.values() if h.region_state is RegionState.QUARANTINED
        )
        return held / self.capacity

    def stats(self, late_chunks_dropped: int) -> ReceiverStats:
        hs = list(self.handles.values())

        def count(rs: RegionState) -> tuple[int, int]:
            sel = [h.region.alloc_bytes for h in hs if h.region_state is rs]
            return len(sel), sum(sel)

        (nf, bf), (nq, bq) = count(RegionState.IN_FLIGHT), count(RegionState.QUARANTINED)
        if self.alloc is not None:
            free = self.alloc.free_bytes
        else:  # direct: bytes of pool slots no transfer holds
            free = self.capacity - sum(
                h.region.alloc_bytes for h in hs if h.region_state is not RegionState.FREE
            )
        return ReceiverStats(
            arena_bytes=self.capacity,
            free_bytes=free,
            in_flight_count=nf,
            in_flight_bytes=bf,
            ready_count=count(RegionState.READY)[0],
            quarantined_count=nq,
            quarantined_bytes=bq,
            late_chunks_dropped=late_chunks_dropped,
            **self.counts,
        )

    def _unlink(self, h: TransferHandle) -> None:
        """`h` needs no answer from its endpoint any more."""
        ep = self.endpoints.get(h.ticket.endpoint)
        if ep is not None:
            ep.handles.discard(h)
