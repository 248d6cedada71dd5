"""The transfer library's exceptions.

Every failure a caller can act on has its own class so the engine can map it to a client error and a
metric label without parsing messages. `TransferError` is the root; nothing here is a `TandemError`
because `transfer/` knows nothing of the engines (they wrap these at their own seam).
"""

from __future__ import annotations


class TransferError(Exception):
    """Base of every error raised or reported (via `TransferHandle.error`) by `tandem.transfer`."""


class TransferTimeout(TransferError):
    """The receiver's deadline passed before P reported DONE."""


class PeerRestarted(TransferError):
    """P's instance id is not the one the ticket names: the offer died with the old process."""


class PeerLost(TransferError):
    """The control connection to P failed (refused, reset or closed) before the transfer finished."""


class LayoutMismatch(TransferError):
    """P and D disagree on the KV wire layout; nothing was copied."""


class ChecksumMismatch(TransferError):
    """The bytes D received do not hash to the checksum P computed over its staging buffer."""


class UnknownTransfer(TransferError):
    """P does not hold the offer (never offered, expired, aborted or already pulled); nothing was copied."""


class TransferExpired(UnknownTransfer):
    """P refused the PULL because the offer's TTL or the PULL's remaining deadline had passed."""


class PathUnavailable(TransferError):
    """A data path's probe failed, or the required path is not the one that works. Never silent."""


class PathMismatch(TransferError):
    """P and D were configured with different data paths."""


class CopyFailed(TransferError):
    """P's gather or copy raised; P proved the copy is over before reporting it."""


class ArenaExhausted(TransferError):
    """The receive arena has no free range large enough; the engine should retry or shed load."""


class ProtocolError(TransferError):
    """A malformed or unexpected control frame; the connection that carried it is closed."""


class UnsafeControlDir(TransferError):
    """The control socket directory exists but is not ours, not a directory, or not mode 0700."""


class SenderClosed(TransferError):
    """The sender is closing or has called `on_fatal`; it accepts no new offers or pulls."""
