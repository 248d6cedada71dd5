"""D's side: allocate receive regions, PULL from P, verify, and reclaim failed regions only with proof.

A transfer's journey: `request()` allocates a region and queues or sends PULL -> REQUESTED -> DONE
arrives, the checksum of the region is verified -> VERIFIED (the engine scatters `handle.tensor()`)
-> `complete()` frees the region. A failure before DONE (deadline, P refused, connection lost) makes
`poll()` return FAILED at once, but if the PULL left D the region is QUARANTINED: P may still write it.
Only a proof frees it (see `ReleaseReason`, docs/protocol.md): P's ABORT_ACK, a late DONE or FAILED for
that PULL, a different P instance at the endpoint, or the endpoint's instance lock being free. Time
alone never does. Meanwhile the maintenance thread re-sends ABORT every `abort_retry_s` (on the same
connection, after reconnects, after a stopped P resumes) and probes every known endpoint every
`probe_interval_s` even with no traffic, so a restarted P is discovered by a draining D.

In direct mode (`direct=True`, paths with `direct_write`) the arena is D's KV pool (`pool_view()`, the
engine builds its pool on it) and a transfer's "region" is the destination slots the engine reserved
and passes to `request`: the PULL_ROWS names them, P writes them in place, D verifies them in place,
and the engine finds the KV already in its pages (no scatter). The same proofs guard them: a failed
transfer's slots come back to the engine (`on_dest_free`) only when no byte of it can still land.

On a path whose receiver writes every byte itself (`path.receiver_writes`: tcp) D needs none of those
proofs: `arena.expect(region, tid)` goes before the PULL, `arena.forget(region)` before every free, and
after `forget` every chunk of the transfer is dropped. So a failed transfer's region is freed at once
(`ReleaseReason.RECEIVER_DROPS`), never quarantined, and no ABORT is sent for it.

A ticket D will never pull (its engine shed the handoff first) is handed to `drop`: the maintenance
thread sends P a DROP for it, so P frees the offer's pages at once instead of at its TTL. D holds
nothing for a dropped ticket, so nothing here waits for an answer (P sends none).

Threads: the engine's (request/poll/complete/drop), one maintenance thread, one reader per P connection.
`on_event` and `on_quarantine_change` run on whichever of them made the change, never under the lock.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ._conn import Connection
from ._endpoint import Endpoint, failure_for
from .arena import Region, RegionAllocator
from .auth import AuthFailed, connect_handshake, ticket_signed
from .checksum import format_checksum, kv_checksum, kv_checksum_rows
from .control import (
    CONTROL_MAGIC,
    CONTROL_ROLES,
    connect_tcp,
    connect_unix,
    control_dir,
    instance_gone,
    parse_tcp_endpoint,
    same_user,
)
from .errors import (
    ArenaExhausted,
    ChecksumMismatch,
    LayoutMismatch,
    PathMismatch,
    PeerLost,
    PeerRestarted,
    ProtocolError,
    TransferError,
    TransferTimeout,
)
from .frames import MAX_FRAME_BYTES, PROTOCOL_VERSION, MsgType, compress_runs
from .handle import TransferHandle
from .layout import WireLayout
from .paths import TransferPath, pool_slots
from .state import ReceiverStats, RegionState, ReleaseReason, Ticket, TransferEvent, TransferState

log = logging.getLogger(__name__)
Actions = list[Callable[[], None]]
_MAX_DROPS = 4096  # DROPs queued per endpoint while it is unreachable; past it the TTL is the backstop
_RELEASE_COUNTER = {
    ReleaseReason.ABORT_ACK: "released_by_ack",
    ReleaseReason.DONE: "released_by_done",
    ReleaseReason.REFUSED: "released_by_refusal",
    ReleaseReason.INSTANCE_CHANGED: "released_by_restart",
    ReleaseReason.INSTANCE_GONE: "released_by_gone",
    ReleaseReason.RECEIVER_DROPS: "released_by_drop",
}


class TransferReceiver:
    """Pulls KV from the P processes of one unit into a receive arena of `arena_bytes`."""

    def __init__(
        self,
        layout: WireLayout,
        unit: str,
        arena_bytes: int,
        path: TransferPath,
        *,
        abort_retry_s: float = 0.5,
        probe_interval_s: float = 1.0,
        connect_timeout_s: float = 1.0,
        lock_proof: bool = True,
        on_event: Callable[[TransferEvent], None] | None = None,
        on_quarantine_change: Callable[[str, bool], None] | None = None,
        secret: bytes | None = None,
        direct: bool = False,
    ) -> None:
        """Called once per D process. `lock_proof=False` disables the process-death proof (an unreachable
        endpoint whose instance lock is free) and leaves only ACK/DONE/FAILED/instance-change; tests use it
        to show that time alone never releases a region. `secret` (the unit secret) lets D follow
        tickets whose endpoint is a P's TCP control listener (`tcp://host:port`, cross-host); only a
        path where D writes every byte itself accepts those (no lock to probe across hosts).

        `direct=True` (only for a path with `direct_write`): the arena of `arena_bytes` (a whole number
        of `layout.token_bytes` slots) is D's KV pool, see `pool_view`; `request` then takes the
        destination slots."""
        if direct and not path.direct_write:
            raise TransferError(f"the {path.name} path cannot write D's pool directly (direct=True)")
        if direct:
            pool_slots(layout, arena_bytes, "direct mode: a")  # before anything is allocated
        self.layout = layout
        self.path = path
        self.direct = direct
        self.instance_id = secrets.token_hex(16)
        self._dir = control_dir(unit)
        self._alloc = RegionAllocator(arena_bytes) if not direct else None
        self._capacity = arena_bytes
        self._arena = path.create_arena(arena_bytes, f"{unit}-{self.instance_id[:8]}")
        self._pool = self._arena.pool_view(layout) if direct else None
        self._abort_retry_s = abort_retry_s
        self._probe_interval_s = probe_interval_s
        self._connect_timeout_s = connect_timeout_s
        self._lock_proof = lock_proof
        self._secret = secret
        self._on_event = on_event
        self._on_quarantine_change = on_quarantine_change
        self._lock = threading.Lock()
        self._verify_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._handles: dict[str, TransferHandle] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._kick = threading.Event()
        self._stop = threading.Event()
        self._readers: list[threading.Thread] = []
        self._counts = dict.fromkeys(
            (
                "transfers_ok",
                "transfers_failed",
                "verify_ok",
                "verify_mismatch",
                "bytes_moved",
                "aborts_sent",
                "drops_sent",
                "drops_refused",
                *_RELEASE_COUNTER.values(),
            ),
            0,
        )
        self._tick = min(0.05, abort_retry_s / 2, probe_interval_s / 2)
        self._maint = threading.Thread(target=self._maintenance_loop, name="tandem-d-maint", daemon=True)
        self._maint.start()

    # ---- engine API ------------------------------------------------------------------------------

    def pool_view(self) -> torch.Tensor:
        """Direct mode: D's KV pool, `layout.staging_shape(S)` over the whole arena (a view; the engine
        owns its contents and its paging, the receiver only the slots of transfers in flight)."""
        if self._pool is None:
            raise TransferError("pool_view() is for a direct-mode receiver")
        return self._pool

    def request(
        self,
        ticket: Ticket,
        deadline_s: float,
        dest: np.ndarray | None = None,
        on_dest_free: Callable[[], None] | None = None,
    ) -> TransferHandle:
        """Called by D once per ticket (its admission thread), after it reserved destination pages; any
        thread. Never blocks on P.

        Region mode: allocates the receive region (owned by the transfer from now on) and sends or
        queues the PULL. Direct mode: `dest` (int64 [n_tokens], slots of `pool_view()`) belongs to the
        transfer from now on and the PULL_ROWS names it; if the transfer ends FAILED, `on_dest_free()`
        is called exactly once (any thread, no lock held) after the engine's `complete` and once no byte
        of it can still land — only then may the engine reuse those slots. A VERIFIED transfer's slots
        are the engine's again at `complete` (no callback).
        Raises at once, with nothing allocated, on `LayoutMismatch`, `PathMismatch`, a ticket from
        another unit, a duplicate id, bad `dest`, or `ArenaExhausted` (retry later or shed load).
        Everything after this is reported through `poll()`; the engine must call `complete(handle)`
        once it is terminal.
        """
        if ticket.layout_fp != self.layout.fingerprint() or ticket.nbytes != self.layout.staging_nbytes(
            ticket.n_tokens
        ):
            raise LayoutMismatch(
                f"ticket layout {ticket.layout_fp} ({ticket.nbytes} bytes) != ours "
                f"{self.layout.fingerprint()} ({self.layout.describe()}): P and D must store the same KV "
                "dtype and scales"
            )
        if ticket.path != self.path.name:
            raise PathMismatch(f"ticket wants path {ticket.path!r}, this receiver uses {self.path.name!r}")
        foreign = self._foreign(ticket)
        if foreign is not None:
            raise TransferError(foreign)
        runs = self._dest_runs(ticket, dest)
        actions: Actions = []
        with self._lock:
            if self._stop.is_set():
                raise TransferError("receiver is closed")
            if ticket.transfer_id in self._handles:
                raise TransferError(f"transfer {ticket.transfer_id} already requested")
            if self._alloc is None:  # direct: the slots are the region; this one is for accounting
                region: Region | None = Region(offset=0, nbytes=ticket.nbytes, alloc_bytes=ticket.nbytes)
            else:
                region = self._alloc.allocate(ticket.nbytes)
            if region is None:
                raise ArenaExhausted(f"no {ticket.nbytes}-byte range free in the receive arena")
            h = TransferHandle(ticket, region, time.monotonic() + deadline_s, self.layout, self._arena)
            if runs is not None:  # our own copy: D verifies exactly the slots P was told to write
                h.dest, h.dest_runs, h.on_dest_free = np.array(dest, copy=True), runs, on_dest_free
            self._handles[ticket.transfer_id] = h
            ep = self._endpoints.get(ticket.endpoint)
            if ep is None:
                ep = self._endpoints[ticket.endpoint] = Endpoint(ticket.endpoint, ticket.lock_path)
            if ep.ready:
                self._dispatch(ep, [h], actions)
            else:
                ep.queued.append(h)
                self._kick.set()
        _run(actions)
        return h

    def _foreign(self, ticket: Ticket) -> str | None:
        """Why D must not follow `ticket`'s endpoint (None: a P of this unit): a unix endpoint
        outside this unit's control directory, or a tcp one on a path where D does not write every
        byte, without the unit secret, or in a ticket the unit secret did not sign."""
        if parse_tcp_endpoint(ticket.endpoint) is not None:
            if not self.path.receiver_writes:
                return (
                    f"ticket endpoint {ticket.endpoint} is a tcp control endpoint, which only a path where "
                    f"D writes every byte (tcp) may follow; this receiver uses {self.path.name}"
                )
            if self._secret is None:
                return f"ticket endpoint {ticket.endpoint} needs the unit secret, none configured"
            if not ticket_signed(self._secret, ticket.signing_bytes(), ticket.mac):
                return (
                    f"ticket for {ticket.endpoint} is not signed with this unit's secret: refused "
                    "(D connects only to P endpoints its own unit issued)"
                )
        elif Path(ticket.endpoint).parent != self._dir or Path(ticket.lock_path).parent != self._dir:
            return f"ticket endpoint {ticket.endpoint} is not in this unit's {self._dir}"
        return None

    def drop(self, ticket: Ticket) -> bool:
        """Called by D's engine (any thread) once for a ticket it will never `request`: it shed the
        handoff before pulling (queue full, admission wait over, refused, cancelled, closing). Never
        blocks: the maintenance thread connects if needed and sends P a DROP naming the ticket's
        transfer id and P instance, and P ends the offer (its pages come back) if nobody pulled it.

        Returns True when the DROP is queued. False, with nothing sent, for a ticket D must not
        follow (`request` would refuse its endpoint too: another unit's, an unsigned tcp one; logged
        as a warning), for one this receiver has requested (its transfer ends by its own rules, never
        by a DROP), when closed, or with `_MAX_DROPS` already queued for an unreachable P. A DROP
        is lost if P cannot be reached or a new P instance answers at the endpoint (the offer died
        with the old one); P's TTL is the backstop then. No answer comes back and none is needed: D
        holds nothing of a ticket it never requested."""
        foreign = self._foreign(ticket)
        refused = foreign
        with self._lock:
            if refused is None and self._stop.is_set():
                refused = "the receiver is closed"
            elif refused is None and ticket.transfer_id in self._handles:
                refused = "D requested it: its transfer ends by its own rules, not by a DROP"
            ep = self._endpoints.get(ticket.endpoint)
            if refused is None and ep is not None and len(ep.drops) >= _MAX_DROPS:
                refused = f"{_MAX_DROPS} DROPs already wait for {ticket.endpoint}"
            if refused is not None:
                self._counts["drops_refused"] += 1
            else:
                if ep is None:
                    ep = self._endpoints[ticket.endpoint] = Endpoint(ticket.endpoint, ticket.lock_path)
                ep.drops.append((ticket.transfer_id, ticket.instance_id))
                self._kick.set()
        if refused is not None:
            level = logging.WARNING if foreign is not None else logging.INFO
            log.log(level, "no DROP for transfer %s: %s", ticket.transfer_id, refused)
        return refused is None

    def _dest_runs(self, ticket: Ticket, dest: np.ndarray | None) -> list[int] | None:
        """Direct mode: `dest` checked and compressed for the PULL_ROWS (None in region mode)."""
        if self._pool is None:
            if dest is not None:
                raise TransferError("destination slots given to a region-mode receiver")
            return None
        if dest is None or dest.dtype != np.int64 or dest.ndim != 1 or dest.size != ticket.n_tokens:
            raise TransferError(
                f"direct mode needs {ticket.n_tokens} int64 destination slots, got {dest!r:.80}"
            )
        slots = self._pool.shape[2]
        if dest.size and (int(dest.min()) < 0 or int(dest.max()) >= slots):
            raise TransferError(f"destination slots outside the pool's {slots}")
        runs = compress_runs(dest)
        if 24 * len(runs) > MAX_FRAME_BYTES - 1024:  # digits + separator per int, worst case
            raise TransferError(
                f"destination of {ticket.transfer_id} is {len(runs) // 2} separate runs: too fragmented "
                "for one PULL_ROWS (use larger pages)"
            )
        return runs

    def poll(self, handle: TransferHandle) -> TransferState:
        """Called by the engine loop every iteration for each open handle; non-blocking.

        REQUESTED/DONE: keep waiting. VERIFIED: scatter `handle.tensor()`, then `complete()`. FAILED:
        error the client stream now (`handle.error` says why), then `complete()`; the region may stay
        quarantined in the background — the engine does not own it and must not wait for it.
        """
        actions: Actions = []
        with self._lock:
            if handle.state is TransferState.REQUESTED and time.monotonic() > handle.deadline:
                self._fail(
                    handle, TransferTimeout(f"no DONE within the deadline for {handle.transfer_id}"), actions
                )
            state = handle.state
        _run(actions)
        return state

    def complete(self, handle: TransferHandle) -> None:
        """Called by the engine exactly once per handle, after `poll` returned VERIFIED (and it scattered
        the tensor) or FAILED. A VERIFIED handle's region is freed now (direct: its slots are simply the
        engine's); a FAILED one's when its proof arrives (or already was; direct: `on_dest_free` then).
        The handle and its tensor view are invalid afterwards."""
        actions: Actions = []
        with self._lock:
            if handle.engine_done:
                raise TransferError(f"complete() called twice for {handle.transfer_id}")
            if handle.state is TransferState.VERIFIED:
                handle.state = TransferState.RELEASED
                self._free(handle, None)
            elif handle.state is not TransferState.FAILED:
                raise TransferError(f"complete() on a {handle.state.name} transfer {handle.transfer_id}")
            handle.engine_done = True
            self._forget_if_done(handle, actions)
        _run(actions)

    def held_fraction(self) -> float:
        """Quarantined bytes / arena bytes: the drain signal (the engine stops admitting above 0.25)."""
        with self._lock:
            held = sum(
                h.region.alloc_bytes
                for h in self._handles.values()
                if h.region_state is RegionState.QUARANTINED
            )
        return held / self._capacity

    def stats(self) -> ReceiverStats:
        """Snapshot for metrics; any thread, any time."""
        with self._lock:
            hs = list(self._handles.values())

            def count(rs: RegionState) -> tuple[int, int]:
                sel = [h.region.alloc_bytes for h in hs if h.region_state is rs]
                return len(sel), sum(sel)

            (nf, bf), (nq, bq) = count(RegionState.IN_FLIGHT), count(RegionState.QUARANTINED)
            if self._alloc is not None:
                free = self._alloc.free_bytes
            else:  # direct: bytes of pool slots no transfer holds
                free = self._capacity - sum(
                    h.region.alloc_bytes for h in hs if h.region_state is not RegionState.FREE
                )
            return ReceiverStats(
                arena_bytes=self._capacity,
                free_bytes=free,
                in_flight_count=nf,
                in_flight_bytes=bf,
                ready_count=count(RegionState.READY)[0],
                quarantined_count=nq,
                quarantined_bytes=bq,
                late_chunks_dropped=self._arena.late_chunks_dropped(),
                **self._counts,
            )

    def close(self) -> None:
        """Called once at engine shutdown. Stops all threads and unmaps the arena. Quarantined regions
        are not reused by anyone: the memory lives on only in P's mapping and dies with it."""
        self._stop.set()
        self._kick.set()
        self._maint.join(5.0)
        actions: Actions = []
        with self._lock:
            for ep in self._endpoints.values():  # the last sheds (close fails the queue) still count
                self._send_drops(ep, actions)
        _run(actions)
        with self._lock:
            conns = [ep.conn for ep in self._endpoints.values() if ep.conn is not None]
        for conn in conns:
            conn.shutdown()
        for t in self._readers:
            t.join(2.0)
        self._arena.close()

    # ---- transitions (self._lock held; callbacks go to `actions`) ------------------------------------

    def _dispatch(self, ep: Endpoint, handles: list[TransferHandle], actions: Actions) -> None:
        """Send PULLs on the ready connection, or fail handles whose ticket names another instance."""
        assert ep.conn is not None and ep.instance is not None
        conn, now = ep.conn, time.monotonic()
        for h in handles:
            if h.state is not TransferState.REQUESTED:
                continue
            if h.ticket.instance_id != ep.instance:
                self._fail(
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

    def _fail(
        self, h: TransferHandle, exc: TransferError, actions: Actions, proof: ReleaseReason | None = None
    ) -> None:
        """Engine-visible failure. With `proof` (or if the PULL never left, or the path's receiver
        writes every byte and drops what it no longer expects) the region is freed, otherwise
        quarantined until a proof arrives."""
        if h.state not in (TransferState.REQUESTED, TransferState.DONE):
            return
        h.state, h.error = TransferState.FAILED, exc
        self._counts["transfers_failed"] += 1
        if h.sent_instance is None:
            self._free(h, ReleaseReason.NEVER_SENT)
        elif proof is not None:
            self._free(h, proof)
        elif self.path.receiver_writes:
            self._free(h, ReleaseReason.RECEIVER_DROPS)  # `_free` forgets first: no late chunk can land
        else:
            h.region_state, h.last_abort = RegionState.QUARANTINED, 0.0
            if self._on_quarantine_change is not None:
                cb = self._on_quarantine_change
                actions.append(lambda: cb(h.transfer_id, True))
            self._kick.set()  # ABORT goes out on the next tick
        self._emit(h, actions)

    def _release(self, h: TransferHandle, reason: ReleaseReason, actions: Actions) -> None:
        """A proof arrived for a quarantined region: free it."""
        if h.region_state is not RegionState.QUARANTINED:
            return
        self._free(h, reason)
        if self._on_quarantine_change is not None:
            cb = self._on_quarantine_change
            actions.append(lambda: cb(h.transfer_id, False))
        self._forget_if_done(h, actions)

    def _free(self, h: TransferHandle, reason: ReleaseReason | None) -> None:
        self._arena.forget(h.region)  # receiver-written paths: returns once no chunk for it can land
        if self._alloc is not None:
            self._alloc.free(h.region)
        h.region_state, h.released_by = RegionState.FREE, reason
        if reason is not None and reason in _RELEASE_COUNTER:
            self._counts[_RELEASE_COUNTER[reason]] += 1
        ep = self._endpoints.get(h.ticket.endpoint)
        if ep is not None:
            ep.handles.discard(h)

    def _forget_if_done(self, h: TransferHandle, actions: Actions) -> None:
        """Drop a handle both the engine and the proofs are done with; direct mode: a failed transfer's
        slots go back to the engine now (exactly once)."""
        if h.engine_done and h.region_state is RegionState.FREE:
            self._handles.pop(h.transfer_id, None)
            cb, h.on_dest_free = h.on_dest_free, None
            if cb is not None and h.state is TransferState.FAILED:
                actions.append(cb)

    def _emit(self, h: TransferHandle, actions: Actions) -> None:
        if self._on_event is not None:
            cb, event = self._on_event, h.event(self.path.name)
            actions.append(lambda: cb(event))

    def _lost_instance(
        self, ep: Endpoint, reason: ReleaseReason, actions: Actions, keep: str | None = None
    ) -> None:
        """Proof that every P instance at `ep` other than `keep` is gone: fail and free its transfers."""
        for h in list(ep.handles):
            if h.sent_instance == keep:
                continue
            if h.state is TransferState.REQUESTED:
                self._fail(
                    h,
                    PeerRestarted(f"P instance {h.sent_instance} at {ep.path} is gone"),
                    actions,
                    proof=reason,
                )
            else:
                self._release(h, reason, actions)

    # ---- messages from P (reader threads) ----------------------------------------------------------

    def _read_loop(self, ep: Endpoint, conn: Connection, gen: int) -> None:
        try:
            while True:
                kind, msg, _ = conn.reader.read()
                self._on_message(ep, gen, kind, msg)
        except (EOFError, OSError, ProtocolError):
            pass
        finally:
            conn.finish()
            actions: Actions = []
            with self._lock:
                if ep.gen == gen:
                    ep.conn, ep.instance = None, None
                    for h in list(ep.handles):
                        if h.sent_gen == gen:
                            self._fail(h, PeerLost(f"control connection to {ep.path} lost"), actions)
                    for h in ep.queued:
                        self._fail(h, PeerLost(f"control connection to {ep.path} lost"), actions)
                    ep.queued.clear()
                    self._kick.set()
            _run(actions)

    def _on_message(self, ep: Endpoint, gen: int, kind: MsgType, msg: dict[str, object]) -> None:
        actions: Actions = []
        verify: TransferHandle | None = None
        with self._lock:
            if ep.gen != gen:
                return
            ep.last_contact = time.monotonic()
            h = self._handles.get(str(msg.get("tid")))
            if h is not None and h.ticket.endpoint != ep.path:
                h = None
            if kind is MsgType.HELLO_ACK:
                ep.instance = str(msg["instance"])
                self._lost_instance(ep, ReleaseReason.INSTANCE_CHANGED, actions, keep=ep.instance)
                queued, ep.queued = ep.queued, []
                self._dispatch(ep, queued, actions)
                self._due_aborts(ep, time.monotonic(), actions, force=True)
                self._send_drops(ep, actions)
            elif ep.instance is None:
                if kind is not MsgType.FAILED:
                    raise ProtocolError(f"{kind.name} before HELLO_ACK")
                queued, ep.queued = ep.queued, []
                ep.drops.clear()  # P refused our HELLO: it will not take a DROP either (TTL backstop)
                for q in queued:
                    self._fail(q, failure_for(int(msg["reason"]), str(msg["detail"])), actions)  # type: ignore[call-overload]
            elif kind is MsgType.PONG:
                if msg["instance"] != ep.instance:
                    raise ProtocolError("PONG instance differs from HELLO_ACK on one connection")
            elif h is None or h.sent_gen < 0:
                pass  # late or duplicate message for a transfer D already forgot: harmless
            elif kind is MsgType.ABORT_ACK:
                if h.sent_instance == ep.instance:
                    self._release(h, ReleaseReason.ABORT_ACK, actions)
            elif h.sent_gen != gen:
                pass  # DONE/FAILED answer the PULL on its own connection only
            elif kind is MsgType.DONE:
                if h.state is TransferState.REQUESTED:
                    h.state = TransferState.DONE
                    h.stamps.copy_start_ns = int(msg["copy_start_ns"])  # type: ignore[call-overload]
                    h.stamps.copy_end_ns = int(msg["copy_end_ns"])  # type: ignore[call-overload]
                    h.stamps.done_received_ns = time.time_ns()
                    verify = h
                else:  # a DONE after D gave up still proves the copy is over
                    self._release(h, ReleaseReason.DONE, actions)
            elif kind is MsgType.FAILED:
                err = failure_for(int(msg["reason"]), str(msg["detail"]))  # type: ignore[call-overload]
                if h.state is TransferState.REQUESTED:
                    self._fail(h, err, actions, proof=ReleaseReason.REFUSED)
                else:
                    self._release(h, ReleaseReason.REFUSED, actions)
            else:
                raise ProtocolError(f"unexpected {kind.name} from P")
        _run(actions)
        if verify is not None:
            self._verify(verify, str(msg["checksum"]))

    def _verify(self, h: TransferHandle, theirs: str) -> None:
        """Reader thread, once per DONE: hash the region (owned by the transfer in state DONE).

        On a GPU the hash runs on a stream of its own: on the thread's default stream it would queue
        behind the engine's decode steps. Nothing of D's touches the region before VERIFIED (and the
        engine returns a region only after its scatter read it), and P's copy finished before DONE."""
        if self._pool is not None and h.dest is not None:  # direct: hash the rows in D's pool in place
            with self._verify_stream(self._pool.device):
                dest = torch.from_numpy(h.dest).to(self._pool.device)
                ours = format_checksum(kv_checksum_rows(self._pool, dest))
        else:
            region = self._arena.region_bytes(h.region)
            with self._verify_stream(region.device):
                ours = format_checksum(kv_checksum(region))
        actions: Actions = []
        with self._lock:
            if ours == theirs:
                h.state, h.region_state = TransferState.VERIFIED, RegionState.READY
                h.stamps.verified_ns = time.time_ns()
                for key, n in (("verify_ok", 1), ("transfers_ok", 1), ("bytes_moved", h.ticket.nbytes)):
                    self._counts[key] += n
                self._handles_ep_discard(h)
                self._emit(h, actions)
            else:
                self._counts["verify_mismatch"] += 1
                self._fail(
                    h,
                    ChecksumMismatch(f"{h.transfer_id}: P sent {theirs}, region hashes to {ours}"),
                    actions,
                    proof=ReleaseReason.DONE,
                )
        _run(actions)

    def _verify_stream(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        if device.type != "cuda":
            return contextlib.nullcontext()
        with self._lock:
            stream = self._verify_streams.get(device)
            if stream is None:
                # High priority: the hash is on every new stream's path to its first audio, and the
                # engine's decode steps would otherwise keep the device's SMs ahead of it.
                stream = self._verify_streams[device] = torch.cuda.Stream(device=device, priority=-1)
        return torch.cuda.stream(stream)

    def _handles_ep_discard(self, h: TransferHandle) -> None:
        ep = self._endpoints.get(h.ticket.endpoint)
        if ep is not None:
            ep.handles.discard(h)

    # ---- maintenance thread ----------------------------------------------------------------------

    def _due_aborts(self, ep: Endpoint, now: float, actions: Actions, force: bool = False) -> None:
        conn = ep.conn
        if conn is None or ep.instance is None:
            return
        for h in ep.handles:
            if (
                h.region_state is RegionState.QUARANTINED
                and h.sent_instance == ep.instance
                and (force or now - h.last_abort >= self._abort_retry_s)
            ):
                h.last_abort = now
                self._counts["aborts_sent"] += 1
                actions.append(conn.later(MsgType.ABORT, tid=h.transfer_id))

    def _send_drops(self, ep: Endpoint, actions: Actions) -> None:
        """Queued DROPs go out on a ready connection; those naming another P instance than the one
        that answers are moot (the offer died with its instance) and are forgotten."""
        if not ep.drops or ep.conn is None or ep.instance is None:
            return
        drops, ep.drops = ep.drops, []
        for tid, instance in drops:
            if instance == ep.instance:
                self._counts["drops_sent"] += 1
                actions.append(ep.conn.later(MsgType.DROP, tid=tid, instance=instance))

    def _maintenance_loop(self) -> None:
        while not self._stop.is_set():
            self._kick.wait(self._tick)
            self._kick.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            actions: Actions = []
            to_connect: list[Endpoint] = []
            with self._lock:
                for h in list(self._handles.values()):
                    if h.state is TransferState.REQUESTED and now > h.deadline:
                        self._fail(
                            h, TransferTimeout(f"no DONE within the deadline for {h.transfer_id}"), actions
                        )
                for key, ep in list(self._endpoints.items()):
                    if ep.conn is None:
                        retry = min(self._abort_retry_s, self._probe_interval_s)
                        if ep.queued or ep.drops or now - ep.last_connect >= retry:
                            idle = now - ep.last_contact > 10 * self._probe_interval_s
                            if not (ep.queued or ep.handles or ep.drops) and idle:
                                del self._endpoints[key]  # unreachable and nothing depends on it
                                continue
                            ep.last_connect = now
                            to_connect.append(ep)
                    elif ep.instance is not None:
                        self._due_aborts(ep, now, actions)
                        self._send_drops(ep, actions)
                        if now - ep.last_ping >= self._probe_interval_s:
                            ep.last_ping = now
                            actions.append(ep.conn.later(MsgType.PING, nonce=secrets.randbits(31)))
            _run(actions)
            for ep in to_connect:
                self._connect(ep)

    def _open(self, ep: Endpoint) -> socket.socket:
        """A connected, authenticated control socket to `ep` (unix: peer uid; tcp: unit secret)."""
        tcp = parse_tcp_endpoint(ep.path)
        if tcp is None:
            sock = connect_unix(ep.path, self._connect_timeout_s)
            if not same_user(sock):
                sock.close()
                raise OSError(f"{ep.path} is served by another user")
            return sock
        sock = connect_tcp(*tcp, self._connect_timeout_s)
        try:
            connect_handshake(
                sock, self._secret or b"", CONTROL_MAGIC, CONTROL_ROLES, what="P control endpoint"
            )
        except BaseException:
            sock.close()
            raise
        return sock

    def _connect(self, ep: Endpoint) -> None:
        actions: Actions = []
        try:
            sock = self._open(ep)
        except (OSError, EOFError, AuthFailed) as exc:
            with self._lock:
                for h in ep.queued:
                    self._fail(h, PeerLost(f"cannot reach P at {ep.path}: {exc}"), actions)
                ep.queued.clear()
                ep.drops.clear()  # P unreachable: its offers expire at their TTL (or died with it)
                if self._lock_proof and ep.handles and ep.lock_path and instance_gone(ep.lock_path):
                    self._lost_instance(ep, ReleaseReason.INSTANCE_GONE, actions)
            _run(actions)
            return
        conn = Connection(sock)
        with self._lock:
            ep.gen += 1
            ep.conn, ep.instance, ep.last_contact = conn, None, time.monotonic()
            gen = ep.gen
        exp = self._arena.export()
        conn.send(
            MsgType.HELLO,
            fds=exp.fds,
            v=PROTOCOL_VERSION,
            layout=self.layout.to_dict(),
            layout_fp=self.layout.fingerprint(),
            path=self.path.name,
            arena=exp.meta,
            d_instance=self.instance_id,
        )
        t = threading.Thread(target=self._read_loop, args=(ep, conn, gen), name="tandem-d-conn", daemon=True)
        self._readers = [r for r in self._readers if r.is_alive()] + [t]
        t.start()


def _run(actions: Actions) -> None:
    for action in actions:
        action()
