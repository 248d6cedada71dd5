"""tandem.transfer: same-machine KV cache handoff from prefill (P) to decode (D) processes.

Knows nothing of engines or models: it moves a contiguous staging tensor of `WireLayout` from P to D
and enforces the protocol in docs/protocol.md, above all that D reuses the memory of a failed transfer
only with proof that no write for it can still land.

Names load lazily (PEP 562): `import tandem.transfer.control` imports no torch, so torch-free
processes (the launcher, the unit's supervisor) share the control directory's code with the engines.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from .registry import PathOptions, build_path, path_factories
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

_WHERE = {
    "ALIGN": "arena",
    "ArenaExhausted": "errors",
    "ArenaExport": "paths",
    "build_path": "registry",
    "ChecksumMismatch": "errors",
    "control_dir": "control",
    "CopyFailed": "errors",
    "FailReason": "frames",
    "HostShmPath": "paths",
    "kv_checksum": "checksum",
    "LayoutMismatch": "errors",
    "LocalArena": "paths",
    "MsgType": "frames",
    "OfferState": "state",
    "PathMismatch": "errors",
    "PathOptions": "registry",
    "PathUnavailable": "errors",
    "PeerArena": "paths",
    "PeerLost": "errors",
    "PeerRestarted": "errors",
    "ProtocolError": "errors",
    "ReceiverStats": "state",
    "Region": "arena",
    "RegionAllocator": "arena",
    "RegionState": "state",
    "path_factories": "registry",
    "ReleaseReason": "state",
    "select_path": "paths",
    "SenderClosed": "errors",
    "SenderStats": "state",
    "Ticket": "state",
    "TransferError": "errors",
    "TransferEvent": "state",
    "TransferExpired": "errors",
    "TransferHandle": "handle",
    "TransferPath": "paths",
    "TransferReceiver": "receiver",
    "TransferSender": "sender",
    "TransferState": "state",
    "TransferTimeout": "errors",
    "UnknownTransfer": "errors",
    "UnsafeControlDir": "errors",
    "WireLayout": "layout",
}

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
    "path_factories",
    "select_path",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
