"""P's per-offer and per-connection records. Mutated only under the sender's lock."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ._conn import Connection
from .paths.base import PeerArena
from .state import OfferState

GatherFn = Callable[[torch.Tensor], None]
Rows = tuple[torch.Tensor, torch.Tensor]  # (P's pool [L, 2, S, *row], the request's slots [T] int64)


@dataclass(eq=False)
class Peer:
    """One D connection and P's mapping of that D's arena (kept alive by copies that use it)."""

    conn: Connection
    arena: PeerArena | None = None


@dataclass(eq=False)
class Offer:
    """One offer; `pull_*` describe the accepted PULL, `abort_waiters` the connections owed an ACK."""

    tid: str
    n_tokens: int
    nbytes: int
    gather: GatherFn
    expires: float
    rows: Rows | None = None  # P's source rows in place, for a PULL_ROWS (direct write)
    state: OfferState = OfferState.OFFERED
    source_released: bool = False
    pull_peer: Peer | None = None
    pull_offset: int = 0
    pull_dst: list[int] | None = None  # PULL_ROWS: D's destination slots as [start, count, ...] runs
    pull_deadline: float = 0.0
    abort_waiters: list[Connection] = field(default_factory=list)
    held_since: float = 0.0
    copy_start_ns: int = 0
    copy_end_ns: int = 0
