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

Threads: the engine's (request/poll/complete/drop), one maintenance thread, one reader per P connection
(`receiver_loop.py`). `on_event` and `on_quarantine_change` run on whichever of them made the change,
never under the lock. The parts: `pull_checks` (is a ticket D's to follow), `regions` (every state
change, under one lock), `verifier` (the checksum a DONE needs), `receiver_loop` (the threads).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ._actions import Actions, run
from .arena import Region, RegionAllocator
from .control import control_dir
from .errors import ArenaExhausted, TransferError, TransferTimeout
from .handle import TransferHandle
from .layout import WireLayout
from .paths.base import TransferPath, pool_slots
from .pull_checks import check_ticket, dest_runs, foreign
from .receiver_loop import ReceiverLoop
from .regions import RegionBook
from .state import ReceiverStats, Ticket, TransferEvent, TransferState
from .verifier import Verifier

log = logging.getLogger(__name__)
_MAX_DROPS = 4096  # DROPs queued per endpoint while it is unreachable; past it the TTL is the backstop


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
        self._secret = secret
        self._arena = path.create_arena(arena_bytes, f"{unit}-{self.instance_id[:8]}")
        self._pool = self._arena.pool_view(layout) if direct else None
        kick = threading.Event()
        alloc = RegionAllocator(arena_bytes) if not direct else None
        self._book = RegionBook(path, self._arena, alloc, arena_bytes, kick, on_event, on_quarantine_change)
        self._kick = kick
        self._loop = ReceiverLoop(
            self._book,
            Verifier(self._arena, self._pool),
            kick,
            layout=layout,
            path=path,
            arena=self._arena,
            instance_id=self.instance_id,
            secret=secret,
            abort_retry_s=abort_retry_s,
            probe_interval_s=probe_interval_s,
            connect_timeout_s=connect_timeout_s,
            lock_proof=lock_proof,
        )

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
        check_ticket(ticket, self.layout, self.path)
        refused = foreign(ticket, self.path, self._secret, self._dir)
        if refused is not None:
            raise TransferError(refused)
        runs = dest_runs(ticket, dest, self._pool)
        book = self._book
        actions: Actions = []
        with book.lock:
            if self._loop.closed:
                raise TransferError("receiver is closed")
            if ticket.transfer_id in book.handles:
                raise TransferError(f"transfer {ticket.transfer_id} already requested")
            if book.alloc is None:  # direct: the slots are the region; this one is for accounting
                region: Region | None = Region(offset=0, nbytes=ticket.nbytes, alloc_bytes=ticket.nbytes)
            else:
                region = book.alloc.allocate(ticket.nbytes)
            if region is None:
                raise ArenaExhausted(f"no {ticket.nbytes}-byte range free in the receive arena")
            h = TransferHandle(ticket, region, time.monotonic() + deadline_s, self.layout, self._arena)
            if runs is not None:  # our own copy: D verifies exactly the slots P was told to write
                h.dest, h.dest_runs, h.on_dest_free = np.array(dest, copy=True), runs, on_dest_free
            book.handles[ticket.transfer_id] = h
            ep = book.endpoint(ticket)
            if ep.ready:
                book.dispatch(ep, [h], actions)
            else:
                ep.queued.append(h)
                self._kick.set()
        run(actions)
        return h

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
        not_ours = foreign(ticket, self.path, self._secret, self._dir)
        refused = not_ours
        book = self._book
        with book.lock:
            if refused is None and self._loop.closed:
                refused = "the receiver is closed"
            elif refused is None and ticket.transfer_id in book.handles:
                refused = "D requested it: its transfer ends by its own rules, not by a DROP"
            ep = book.endpoints.get(ticket.endpoint)
            if refused is None and ep is not None and len(ep.drops) >= _MAX_DROPS:
                refused = f"{_MAX_DROPS} DROPs already wait for {ticket.endpoint}"
            if refused is not None:
                book.counts["drops_refused"] += 1
            else:
                book.endpoint(ticket).drops.append((ticket.transfer_id, ticket.instance_id))
                self._kick.set()
        if refused is not None:
            level = logging.WARNING if not_ours is not None else logging.INFO
            log.log(level, "no DROP for transfer %s: %s", ticket.transfer_id, refused)
        return refused is None

    def poll(self, handle: TransferHandle) -> TransferState:
        """Called by the engine loop every iteration for each open handle; non-blocking.

        REQUESTED/DONE: keep waiting. VERIFIED: scatter `handle.tensor()`, then `complete()`. FAILED:
        error the client stream now (`handle.error` says why), then `complete()`; the region may stay
        quarantined in the background — the engine does not own it and must not wait for it.
        """
        actions: Actions = []
        with self._book.lock:
            if handle.state is TransferState.REQUESTED and time.monotonic() > handle.deadline:
                self._book.fail(
                    handle, TransferTimeout(f"no DONE within the deadline for {handle.transfer_id}"), actions
                )
            state = handle.state
        run(actions)
        return state

    def complete(self, handle: TransferHandle) -> None:
        """Called by the engine exactly once per handle, after `poll` returned VERIFIED (and it scattered
        the tensor) or FAILED. A VERIFIED handle's region is freed now (direct: its slots are simply the
        engine's); a FAILED one's when its proof arrives (or already was; direct: `on_dest_free` then).
        The handle and its tensor view are invalid afterwards."""
        actions: Actions = []
        with self._book.lock:
            if handle.engine_done:
                raise TransferError(f"complete() called twice for {handle.transfer_id}")
            if handle.state is TransferState.VERIFIED:
                handle.state = TransferState.RELEASED
                self._book.free(handle, None)
            elif handle.state is not TransferState.FAILED:
                raise TransferError(f"complete() on a {handle.state.name} transfer {handle.transfer_id}")
            handle.engine_done = True
            self._book.forget_if_done(handle, actions)
        run(actions)

    def held_fraction(self) -> float:
        """Quarantined bytes / arena bytes: the drain signal (the engine stops admitting above 0.25)."""
        with self._book.lock:
            return self._book.held_fraction()

    def stats(self) -> ReceiverStats:
        """Snapshot for metrics; any thread, any time."""
        with self._book.lock:
            return self._book.stats(self._arena.late_chunks_dropped())

    def close(self) -> None:
        """Called once at engine shutdown. Stops all threads and unmaps the arena. Quarantined regions
        are not reused by anyone: the memory lives on only in P's mapping and dies with it."""
        self._loop.close()
        self._arena.close()
