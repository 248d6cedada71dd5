"""P's copy workers: each takes an accepted PULL and moves the offer's KV into D's memory.

Who calls: `SenderLoop` queues an offer (state QUEUED, `pull_*` set) with `put`; `TransferSender`
starts and stops the workers. A worker owns the offer while COPYING: region mode gathers into a
staging buffer (the source is released right after), checksums it, runs `copy_hook`, and makes one
copy into D's region; direct mode (PULL_ROWS) writes P's rows into D's slots (`path.write_rows`; the
GPU paths hash them in the same kernel) and releases the source after the write; with a `copy_hook`
that write is still the production call, the hook's fault injected around it. The answer is DONE
with the checksum, FAILED(COPY_ERROR) if the gather or path raised, or the held ABORT_ACKs when D
gave up meanwhile (the copy call has returned: that is the proof).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from ._actions import Actions, run
from ._offer import Offer
from .checksum import format_checksum, kv_checksum, kv_checksum_rows
from .frames import FailReason, MsgType, expand_runs
from .layout import WireLayout
from .offers import OfferBook
from .paths.base import PeerArena, TransferPath
from .state import OfferState


class Copier:
    """`n` daemon workers over one job queue."""

    def __init__(
        self,
        book: OfferBook,
        path: TransferPath,
        layout: WireLayout,
        copy_hook: Callable[[str, torch.Tensor], None] | None,
    ) -> None:
        """`copy_hook(tid, staging)`: the fault-injection seam, called right before the copy crosses
        (it may delay, or alter `staging` to simulate corruption); None in production unless fault
        injection is configured. Region mode: `staging` is what crosses, after its checksum. Direct
        mode: `staging` is a copy of the transfer's first row; the rows still go by the production
        `write_rows`, and an altered row then lands over D's first slot."""
        self._book = book
        self._path = path
        self._layout = layout
        self._copy_hook = copy_hook
        self._jobs: queue.Queue[Offer | None] = queue.Queue()
        self._workers: list[threading.Thread] = []

    def start(self, n: int) -> None:
        for i in range(n):
            t = threading.Thread(target=self._copy_loop, name=f"tandem-p-copy{i}", daemon=True)
            t.start()
            self._workers.append(t)

    def put(self, offer: Offer) -> None:
        self._jobs.put(offer)

    def stop(self, timeout_s: float) -> bool:
        """Let the workers finish the copies in progress; False if one is still running after `timeout_s`."""
        for _ in self._workers:
            self._jobs.put(None)
        end = time.monotonic() + timeout_s
        for t in self._workers:
            t.join(max(0.0, end - time.monotonic()))
        return not any(t.is_alive() for t in self._workers)

    def _copy_loop(self) -> None:
        while True:
            offer = self._jobs.get()
            if offer is None:
                return
            self._copy_one(offer)

    def _copy_one(self, offer: Offer) -> None:
        book = self._book
        actions: Actions = []
        refuse: FailReason | None = None
        peer = offer.pull_peer
        assert peer is not None
        with book.lock:
            if offer.state is not OfferState.QUEUED:  # aborted while queued
                refuse = FailReason.ABORTED
            elif book.closing or book.fatal:
                book.tombstone(offer, OfferState.ABORTED, actions)
                refuse = FailReason.CLOSING
            elif time.monotonic() > offer.pull_deadline:
                book.tombstone(offer, OfferState.EXPIRED, actions)
                refuse = FailReason.EXPIRED
            else:
                offer.state = OfferState.COPYING
                offer.copy_start_ns = time.time_ns()
        run(actions)
        if refuse is not None:
            peer.conn.send(MsgType.FAILED, tid=offer.tid, reason=int(refuse), detail=refuse.name)
            return
        error: str | None = None
        checksum = 0
        try:
            if offer.pull_dst is not None:
                checksum = self._write_rows(offer, offer.pull_dst)
            else:
                staging = self._path.alloc_staging(self._layout, offer.n_tokens)
                try:
                    offer.gather(staging)
                finally:
                    book.release_source(offer)
                checksum = kv_checksum(staging)
                if self._copy_hook is not None:
                    self._copy_hook(offer.tid, staging)
                assert peer.arena is not None
                self._path.copy_to_peer(staging, peer.arena, offer.pull_offset, offer.tid)
        except Exception as exc:  # the engine's gather or the path failed; the copy call has returned
            error = f"{type(exc).__name__}: {exc}"
        with book.lock:
            offer.copy_end_ns = time.time_ns()
            final = OfferState.COPIED if error is None else OfferState.FAILED
            book.finish(offer, final)
            waiters, offer.abort_waiters = offer.abort_waiters, []
            book.counts["copies_ok" if error is None else "copies_failed"] += 1
            book.counts["bytes_moved"] += offer.nbytes if error is None else 0
            book.counts["acks_sent"] += len(waiters)
            event = book.event(offer, error)
        if waiters:  # D gave up: the ACK (now provable) is the only answer it needs
            for conn in waiters:
                conn.send(MsgType.ABORT_ACK, tid=offer.tid)
        elif error is None:
            peer.conn.send(
                MsgType.DONE,
                tid=offer.tid,
                nbytes=offer.nbytes,
                checksum=format_checksum(checksum),
                copy_start_ns=offer.copy_start_ns,
                copy_end_ns=offer.copy_end_ns,
            )
        else:
            peer.conn.send(MsgType.FAILED, tid=offer.tid, reason=int(FailReason.COPY_ERROR), detail=error)
        if book.on_event is not None:
            book.on_event(event)

    def _write(self, src: torch.Tensor, src_slots: torch.Tensor, arena: PeerArena, dst: torch.Tensor) -> int:
        """The production write of direct mode; returns the checksum of P's rows (the GPU paths hash
        them as their kernel writes them, others are hashed here)."""
        written = self._path.write_rows(self._layout, src, src_slots, arena, dst)
        return kv_checksum_rows(src, src_slots) if written is None else written

    def _write_rows(self, offer: Offer, runs: list[int]) -> int:
        """Direct mode: write P's rows into D's pool at `runs` and checksum them (in the write's own
        kernel on the GPU paths), release the source once the write returned (whatever happened).
        Returns the checksum of what P wrote."""
        try:
            assert (
                offer.rows is not None and offer.pull_peer is not None and offer.pull_peer.arena is not None
            )
            src, src_slots = offer.rows
            dst = torch.from_numpy(expand_runs(runs)).to(src.device)
            arena = offer.pull_peer.arena
            if self._copy_hook is None:
                return self._write(src, src_slots, arena, dst)
            # Fault injection around the production write: the hook sees a copy of the first row (it may
            # delay, hold or alter it) before the write; the write itself is the production call; an
            # altered row then lands over D's first slot, so D's proof sees what a corrupting copy would
            # leave while P's checksum (and P's pool) stay the rows P meant to send.
            row = self._path.alloc_staging(self._layout, 1)
            row.copy_(src.index_select(2, src_slots[:1]))
            sent = row.clone()
            self._copy_hook(offer.tid, row)
            checksum = self._write(src, src_slots, arena, dst)
            if not torch.equal(row.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)):
                first = torch.zeros(1, dtype=torch.int64, device=row.device)
                self._path.write_rows(self._layout, row, first, arena, dst[:1].to(row.device))
            return checksum
        finally:
            self._book.release_source(offer)
