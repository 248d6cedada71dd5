"""D's handle on one transfer: its ticket, its receive region, and the state the receiver keeps for it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .arena import Region
from .errors import TransferError
from .layout import WireLayout
from .paths.base import LocalArena
from .state import RegionState, ReleaseReason, Ticket, TransferEvent, TransferState


@dataclass(eq=False)
class _Stamps:
    request_sent_ns: int = 0
    copy_start_ns: int = 0
    copy_end_ns: int = 0
    done_received_ns: int = 0
    verified_ns: int = 0


@dataclass(eq=False)
class TransferHandle:
    """Returned by `TransferReceiver.request`; the engine keeps it until it calls `complete(handle)`.

    Read-only for the engine: `ticket`, `state` (prefer `receiver.poll`), `error` (set when FAILED),
    `region_state` and `released_by` (for diagnostics). Every field is written only by the receiver,
    under its lock.
    """

    ticket: Ticket
    region: Region
    deadline: float  # time.monotonic() at which an unfinished transfer fails
    layout: WireLayout
    arena: LocalArena
    state: TransferState = TransferState.REQUESTED
    region_state: RegionState = RegionState.IN_FLIGHT
    error: TransferError | None = None
    released_by: ReleaseReason | None = None
    sent_instance: str | None = None  # the P instance that received our PULL (None: never sent)
    sent_gen: int = -1  # which control connection carried the PULL
    last_abort: float = 0.0
    engine_done: bool = False  # the engine called complete()
    stamps: _Stamps = field(default_factory=_Stamps)
    dest: np.ndarray | None = None  # direct mode: D's destination slots (the region)
    dest_runs: list[int] | None = None  # direct mode: `dest` as PULL_ROWS runs
    on_dest_free: Callable[[], None] | None = None  # direct mode: slots back to the engine (FAILED)

    @property
    def transfer_id(self) -> str:
        return self.ticket.transfer_id

    def tensor(self) -> torch.Tensor:
        """The received KV, shaped `layout.staging_shape(n_tokens)`: a view of the receive region, no copy.

        Valid only while the handle is VERIFIED, i.e. from `poll() == VERIFIED` until the engine calls
        `complete(handle)`; the engine scatters it into its pages in between and must not keep the view.
        """
        if self.state is not TransferState.VERIFIED:
            raise TransferError(f"transfer {self.transfer_id} is {self.state.name}, not VERIFIED")
        if self.dest is not None:
            raise TransferError(f"transfer {self.transfer_id} was written into D's pool directly: no region")
        raw = self.arena.region_bytes(self.region)
        return raw.view(self.layout.dtype).view(self.layout.staging_shape(self.ticket.n_tokens))

    def event(self, path: str) -> TransferEvent:
        s = self.stamps
        return TransferEvent(
            self.transfer_id,
            self.ticket.nbytes,
            self.state.name,
            None if self.error is None else f"{type(self.error).__name__}: {self.error}",
            path,
            s.request_sent_ns,
            s.copy_start_ns,
            s.copy_end_ns,
            s.done_received_ns,
            s.verified_ns,
        )
