"""D's record of one P endpoint, and the mapping from P's FAILED reasons to exceptions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._conn import Connection
from .errors import (
    CopyFailed,
    LayoutMismatch,
    PathMismatch,
    SenderClosed,
    TransferError,
    TransferExpired,
    UnknownTransfer,
)
from .frames import FailReason

if TYPE_CHECKING:
    from .handle import TransferHandle


@dataclass(eq=False)
class Endpoint:
    """One P control socket as D sees it. Mutated only under the receiver's lock.

    `gen` numbers the connections; a reply is matched to a PULL only on the connection that carried it.
    `instance` is the P instance id from the current connection's HELLO_ACK (None while handshaking
    or disconnected). `handles` are transfers whose PULL went to this endpoint and that still need an
    answer or a proof; `queued` wait for the handshake. `drops` are (transfer id, P instance) of
    tickets D shed without pulling, waiting for a ready connection to be sent as DROPs.
    """

    path: str
    lock_path: str
    conn: Connection | None = None
    gen: int = 0
    instance: str | None = None
    queued: list[TransferHandle] = field(default_factory=list)
    handles: set[TransferHandle] = field(default_factory=set)
    drops: list[tuple[str, str]] = field(default_factory=list)
    last_connect: float = float("-inf")
    last_ping: float = 0.0
    last_contact: float = 0.0

    @property
    def ready(self) -> bool:
        return self.conn is not None and self.conn.alive and self.instance is not None


_FAILURES: dict[FailReason, type[TransferError]] = {
    FailReason.UNKNOWN: UnknownTransfer,
    FailReason.EXPIRED: TransferExpired,
    FailReason.ABORTED: UnknownTransfer,
    FailReason.LAYOUT_MISMATCH: LayoutMismatch,
    FailReason.PATH_MISMATCH: PathMismatch,
    FailReason.COPY_ERROR: CopyFailed,
    FailReason.CLOSING: SenderClosed,
}


def failure_for(reason: int, detail: str) -> TransferError:
    """The exception D reports for P's FAILED(reason)."""
    try:
        kind = FailReason(reason)
    except ValueError:
        return TransferError(f"P failed the transfer with unknown reason {reason}: {detail}")
    return _FAILURES.get(kind, TransferError)(f"P: {kind.name}: {detail}")
