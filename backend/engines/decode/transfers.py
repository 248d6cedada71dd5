"""D's waiting transfers: streams whose KV is crossing from P, and the proofs that free their memory.

Engine thread only: D's engine loop calls every method, and `waiting` and `scattering` are touched
by no other thread. It talks to the receiver only through its engine API (`poll`, `complete`,
`TransferHandle.tensor`).

A waiting stream ends exactly once: VERIFIED (region mode: scattered into its pages; direct: the rows
are there already) -> `join` the batch; FAILED -> `fail` tells the client now, its pages come back at
once except, direct mode, its prompt pages, which the receiver returns with proof (`on_dest_free` ->
`Membership.return_held`); dead (an engine fault failed it already) -> its handle is completed when
terminal.

Ownership: the receive region (direct: the prompt's slots) belongs to the transfer until VERIFIED or
a proof; a VERIFIED region is the engine's until `complete`. On a GPU the scatter is queued behind
the running step, so the region returns only once an event recorded after it has passed.

Failure: an exception while handling one entry propagates to the engine loop's fault handler. Each
entry leaves `waiting` as it is handled, before effects that cannot be undone, so `waiting` is exact
for that handler (`fail_all`); `join` and `fail` are passed in so that an entry joins before the
next one is polled and no verified stream is ever outside both `waiting` and the batch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.backend.engines.decode.admission import Membership
from tandem.backend.engines.stream import Stream, StreamStatus
from tandem.transfer import TransferHandle, TransferReceiver, TransferState

log = logging.getLogger("tandem")


@dataclass
class Waiting:
    stream: Stream
    handle: TransferHandle
    first_row: np.ndarray
    dead: bool = False  # failed by an engine fault: complete the handle when terminal, never join


class WaitingTransfers:
    def __init__(
        self,
        receiver: TransferReceiver,
        members: Membership,
        direct: bool,
        join: Callable[[Stream, np.ndarray], None],
        fail: Callable[[Stream, str], None],
    ) -> None:
        """`join(stream, first_row)`: the stream enters the batch (engine). `fail(stream, reason)`:
        the client is told (engine: status, metrics, sink)."""
        self.receiver = receiver
        self.members = members
        self.pool = members.pool
        self.direct = direct
        self._join = join
        self._fail = fail
        self.waiting: list[Waiting] = []
        self.scattering: list[tuple[torch.cuda.Event, TransferHandle]] = []

    def __len__(self) -> int:
        return len(self.waiting)

    def wait(self, stream: Stream, handle: TransferHandle, first_row: np.ndarray) -> None:
        """An admitted stream starts waiting for its KV."""
        stream.status = StreamStatus.WAITING_KV
        self.waiting.append(Waiting(stream, handle, first_row))

    def wait_dead(self, stream: Stream, handle: TransferHandle, first_row: np.ndarray) -> None:
        """A stream that failed before it could wait: its region returns once the transfer is terminal."""
        self.waiting.append(Waiting(stream, handle, first_row, dead=True))

    def poll(self) -> None:
        """Each entry leaves `waiting` right when it is handled.

        A verified transfer's stream gets its transfer stamps in waterfall order: `copy_start`,
        `copy_end` (P's, carried in DONE), `d_done` (D's reader thread received DONE),
        `d_checksummed` (the reader's checksum matched), then `verified`: this thread picked the
        stream up and queued the scatter into its pages (the scatter may still be running)."""
        self.complete_scattered()
        for w in list(self.waiting):
            state = self.receiver.poll(w.handle)
            if w.dead:  # its stream already failed (engine fault); its pages went back (direct: held)
                if state in (TransferState.VERIFIED, TransferState.FAILED):
                    self.waiting.remove(w)
                    self.receiver.complete(w.handle)  # FAILED, direct: the receiver returns them
                    if state is TransferState.VERIFIED:
                        self.members.return_held(w.stream)
                continue
            if state is TransferState.VERIFIED:
                self._verified(w)
            elif state is TransferState.FAILED:
                self.waiting.remove(w)
                # leave before complete: in direct mode complete may call back (`return_held`) at once
                self.members.leave(w.stream, joined=False, hold=self.direct)
                self.receiver.complete(w.handle)
                self._fail(w.stream, f"KV transfer {w.handle.transfer_id} failed: {w.handle.error}")
            # else still crossing; a cancelled client is dropped by the batch once the KV is in

    def _verified(self, w: Waiting) -> None:
        s = w.stream
        assert s.slots is not None
        if not self.direct:
            kv = w.handle.tensor()
            self.pool.scatter(s.slots[: s.prompt_len], kv.to(self.pool.device, non_blocking=False))
        self.waiting.remove(w)
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
            if not w.handle.engine_done and all(h is not w.handle for _, h in self.scattering):
                with contextlib.suppress(Exception):  # the region goes back (it was verified)
                    self.receiver.complete(w.handle)
            if s.status is not StreamStatus.RUNNING:  # never joined: nobody else owns it now
                self.members.leave(s, joined=False)
                self._fail(s, "decode engine fault while the stream's KV was joining")
            raise

    def _release_after_scatter(self, handle: TransferHandle) -> None:
        """Give a verified region back to the receiver only once the scatter has read it: P's next copy
        into a reused region is ordered on nothing of ours. CUDA: when an event recorded after the scatter
        has passed (checked every iteration); CPU: at once."""
        if self.pool.device.type != "cuda":
            self.receiver.complete(handle)
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.pool.device))
        self.scattering.append((event, handle))

    def complete_scattered(self, wait: bool = False) -> None:
        """Regions whose scatter has passed go back to the receiver (`wait`: wait for each; close)."""
        still = []
        for event, handle in self.scattering:
            if wait:
                event.synchronize()
            if event.query():
                self.receiver.complete(handle)
            else:
                still.append((event, handle))
        self.scattering = still

    def fail_all(self, reason: str) -> None:
        """The engine's fault handler: every live waiting stream fails now and leaves (direct mode:
        its prompt pages held for the proof); its handle stays here, dead, until terminal."""
        for w in self.waiting:
            if not w.dead:
                w.dead = True
                self.members.leave(w.stream, joined=False, hold=self.direct)
                try:
                    self._fail(w.stream, reason)
                except Exception:  # one client's broken sink must not keep the others uninformed
                    log.exception("could not fail stream %d", w.stream.stream_id)
