"""tandem.transfer: same-machine KV cache handoff from prefill (P) to decode (D) processes.

Knows nothing of engines or models: it moves a contiguous staging tensor of `WireLayout` from P to D
and enforces the protocol in docs/protocol.md, above all that D reuses the memory of a failed transfer
only with proof that no write for it can still land.
"""

from .arena import ALIGN, Region, RegionAllocator
from .checksum import kv_checksum
from .control import control_dir
from .errors import (
    ArenaExhausted,
    ChecksumMismatch,
    CopyFailed,
    LayoutMismatch,
    PathMismatch,
    PathUnavailable,
    PeerLost,
    PeerRestarted,
    ProtocolError,
    SenderClosed,
    TransferError,
    TransferExpired,
    TransferTimeout,
    UnknownTransfer,
    UnsafeControlDir,
)
from .frames import FailReason, MsgType
from .handle import TransferHandle
from .layout import WireLayout
from .paths import ArenaExport, HostShmPath, LocalArena, PeerArena, TransferPath, select_path
from .receiver import TransferReceiver
from .registry import PathOptions, build_path, registry
from .sender import TransferSender
from .state import (
    OfferState,
    ReceiverStats,
    RegionState,
    ReleaseReason,
    SenderStats,
    Ticket,
    TransferEvent,
    TransferState,
)

__all__ = [
    "ALIGN",
    "ArenaExhausted",
    "ArenaExport",
    "ChecksumMismatch",
    "CopyFailed",
    "FailReason",
    "HostShmPath",
    "LayoutMismatch",
    "LocalArena",
    "MsgType",
    "OfferState",
    "PathMismatch",
    "PathOptions",
    "PathUnavailable",
    "PeerArena",
    "PeerLost",
    "PeerRestarted",
    "ProtocolError",
    "ReceiverStats",
    "Region",
    "RegionAllocator",
    "RegionState",
    "ReleaseReason",
    "SenderClosed",
    "SenderStats",
    "Ticket",
    "TransferError",
    "TransferEvent",
    "TransferExpired",
    "TransferHandle",
    "TransferPath",
    "TransferReceiver",
    "TransferSender",
    "TransferState",
    "TransferTimeout",
    "UnknownTransfer",
    "UnsafeControlDir",
    "WireLayout",
    "build_path",
    "control_dir",
    "kv_checksum",
    "registry",
    "select_path",
]
