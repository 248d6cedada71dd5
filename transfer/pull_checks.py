"""What each side checks of the other's words before any memory moves.

Pure functions: any thread, no lock, nothing allocated. D checks a ticket (`check_ticket`, `foreign`,
`dest_runs`) before `TransferReceiver.request` reserves anything; P checks a HELLO (`hello_refusal`)
and a PULL_ROWS's runs (`bad_dst`) before it maps or writes D's memory. A refusal is a reason string
(or a raised `TransferError` subclass) that the caller passes on unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .auth import ticket_signed
from .control import parse_tcp_endpoint
from .errors import LayoutMismatch, PathMismatch, TransferError
from .frames import MAX_FRAME_BYTES, PROTOCOL_VERSION, FailReason, compress_runs
from .layout import WireLayout
from .paths.base import PeerArena, TransferPath, pool_slots
from .state import Ticket

if TYPE_CHECKING:
    import torch

# ---- D, of a ticket -------------------------------------------------------------------------------


def check_ticket(ticket: Ticket, layout: WireLayout, path: TransferPath) -> None:
    """Raises `LayoutMismatch` or `PathMismatch` unless `ticket` is for D's KV layout and data path."""
    if ticket.layout_fp != layout.fingerprint() or ticket.nbytes != layout.staging_nbytes(ticket.n_tokens):
        raise LayoutMismatch(
            f"ticket layout {ticket.layout_fp} ({ticket.nbytes} bytes) != ours "
            f"{layout.fingerprint()} ({layout.describe()}): P and D must store the same KV "
            "dtype and scales"
        )
    if ticket.path != path.name:
        raise PathMismatch(f"ticket wants path {ticket.path!r}, this receiver uses {path.name!r}")


def foreign(ticket: Ticket, path: TransferPath, secret: bytes | None, unit_dir: Path) -> str | None:
    """Why D must not follow `ticket`'s endpoint (None: a P of this unit): a unix endpoint outside
    `unit_dir`, or a tcp one on a path where D does not write every byte, without the unit secret,
    or in a ticket the unit secret did not sign."""
    if parse_tcp_endpoint(ticket.endpoint) is not None:
        if not path.receiver_writes:
            return (
                f"ticket endpoint {ticket.endpoint} is a tcp control endpoint, which only a path where "
                f"D writes every byte (tcp) may follow; this receiver uses {path.name}"
            )
        if secret is None:
            return f"ticket endpoint {ticket.endpoint} needs the unit secret, none configured"
        if not ticket_signed(secret, ticket.signing_bytes(), ticket.mac):
            return (
                f"ticket for {ticket.endpoint} is not signed with this unit's secret: refused "
                "(D connects only to P endpoints its own unit issued)"
            )
    elif Path(ticket.endpoint).parent != unit_dir or Path(ticket.lock_path).parent != unit_dir:
        return f"ticket endpoint {ticket.endpoint} is not in this unit's {unit_dir}"
    return None


def dest_runs(ticket: Ticket, dest: np.ndarray | None, pool: torch.Tensor | None) -> list[int] | None:
    """Direct mode (`pool` is D's pool view): `dest` checked and compressed for the PULL_ROWS.
    Region mode (`pool` None): None, and `dest` must be None. Raises `TransferError` otherwise."""
    if pool is None:
        if dest is not None:
            raise TransferError("destination slots given to a region-mode receiver")
        return None
    if dest is None or dest.dtype != np.int64 or dest.ndim != 1 or dest.size != ticket.n_tokens:
        raise TransferError(f"direct mode needs {ticket.n_tokens} int64 destination slots, got {dest!r:.80}")
    slots = pool.shape[2]
    if dest.size and (int(dest.min()) < 0 or int(dest.max()) >= slots):
        raise TransferError(f"destination slots outside the pool's {slots}")
    runs = compress_runs(dest)
    if 24 * len(runs) > MAX_FRAME_BYTES - 1024:  # digits + separator per int, worst case
        raise TransferError(
            f"destination of {ticket.transfer_id} is {len(runs) // 2} separate runs: too fragmented "
            "for one PULL_ROWS (use larger pages)"
        )
    return runs


# ---- P, of D's frames -----------------------------------------------------------------------------


def hello_refusal(
    msg: dict[str, object], path: TransferPath, layout: WireLayout
) -> tuple[FailReason, str] | None:
    """Why P refuses D's HELLO (reason and detail for the FAILED), or None: same protocol version,
    data path and KV layout."""
    if msg["v"] != PROTOCOL_VERSION:
        reason = FailReason.BAD_VERSION
    elif msg["path"] != path.name:
        reason = FailReason.PATH_MISMATCH
    elif msg["layout_fp"] != layout.fingerprint() or msg["layout"] != layout.to_dict():
        detail = f"LAYOUT_MISMATCH in HELLO: D's KV is {msg['layout']}, P's {layout.describe()}"
        return FailReason.LAYOUT_MISMATCH, detail
    else:
        return None
    return reason, f"{reason.name} in HELLO"


def bad_dst(layout: WireLayout, arena: PeerArena | None, dst: object, nbytes: int) -> str | None:
    """Why a PULL_ROWS's destination runs cannot be written (None: they can): not [start, count]
    int pairs, a run outside D's pool, or a total that is not `nbytes` of tokens."""
    if arena is None:
        return "no arena"
    try:
        slots = pool_slots(layout, arena.nbytes, "D's")
    except TransferError as exc:
        return str(exc)
    if not isinstance(dst, list) or len(dst) % 2 or not all(type(x) is int for x in dst):
        return "dst is not a flat list of [start, count] int pairs"
    total = 0
    for start, count in zip(dst[::2], dst[1::2], strict=True):
        if count <= 0 or start < 0 or start + count > slots:
            return f"run [{start}, {count}] outside D's {slots} slots"
        total += count
    if total * layout.token_bytes != nbytes:
        return f"{total} destination slots for {nbytes} bytes"
    return None
