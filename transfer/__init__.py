"""tandem.transfer: same-machine KV cache handoff from prefill (P) to decode (D) processes.

Knows nothing of engines or models: it moves a contiguous staging tensor of `WireLayout` from P to D
and enforces the protocol in docs/protocol.md, above all that D reuses the memory of a failed transfer
only with proof that no write for it can still land.

Names load lazily (PEP 562): `import tandem.transfer.control` imports no torch, so torch-free
processes (the launcher, the unit's supervisor) share the control directory's code with the engines.
The public names are written once, as the `TYPE_CHECKING` imports below: type checkers read them
there, and `__getattr__` finds each name's module in the same lines (read with `ast`, not run).
"""

# ruff: noqa: F401 - the TYPE_CHECKING imports are the package's public names, re-exported lazily

from __future__ import annotations

import ast
import importlib
from pathlib import Path
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
    from .paths.base import ArenaExport, LocalArena, PeerArena, TransferPath
    from .paths.host_shm import HostShmPath
    from .paths.registry import PathOptions, build_path, path_factories, select_path
    from .receiver import TransferReceiver
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


def _public_names() -> dict[str, str]:
    """Each public name -> the module that defines it, read from the `TYPE_CHECKING` imports above."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


_WHERE = _public_names()
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
