"""States, the ticket, per-transfer events and stats snapshots shared by sender and receiver."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from enum import IntEnum

_HEX32 = re.compile(r"^[0-9a-f]{32}$")


class TransferState(IntEnum):
    """D's view of one transfer, as `TransferReceiver.poll` reports it."""

    REQUESTED = 1  # region allocated; PULL queued or sent; waiting for DONE
    DONE = 2  # P reported DONE; D is verifying the checksum (transient)
    VERIFIED = 3  # checksum matched; `handle.tensor()` is valid until `complete()`
    FAILED = 4  # terminal for the engine; `handle.error` says why; region may still be quarantined
    RELEASED = 5  # `complete()` was called on a VERIFIED handle; the region is free


class RegionState(IntEnum):
    """Who owns a handle's receive region (the memory P may write)."""

    IN_FLIGHT = 1  # owned by the transfer: P may write it
    READY = 2  # verified; owned by the engine until `complete()`
    QUARANTINED = 3  # the transfer failed but P may still write; freed only on proof
    FREE = 4  # back in the arena


class OfferState(IntEnum):
    """P's view of one offer."""

    OFFERED = 1  # waiting for a PULL; P's source pages are held
    QUEUED = 2  # PULL accepted, waiting for a copy worker; ABORT still tombstones it
    COPYING = 3  # a worker is gathering/copying; an ABORT's ACK must wait
    COPIED = 4  # copy finished (DONE sent or ACK sent)
    FAILED = 5  # gather or copy raised; the copy is over
    ABORTED = 6  # tombstoned before any write (ABORT, DROP, refused PULL, or close)
    EXPIRED = 7  # TTL passed before any PULL


class ReleaseReason(IntEnum):
    """The proof that freed a quarantined region (or an in-flight one after a failure)."""

    ABORT_ACK = 1  # P proved no write for the transfer can still land
    DONE = 2  # P reported the copy completed (possibly after D's deadline)
    REFUSED = 3  # P answered the PULL with FAILED: the copy never started or is over
    INSTANCE_CHANGED = 4  # a different P instance answers at the endpoint: the old one is gone
    INSTANCE_GONE = 5  # the endpoint's instance lock is free: no process that held it remains
    NEVER_SENT = 6  # the PULL never left D
    RECEIVER_DROPS = 7  # D writes every byte itself (tcp) and stopped expecting the transfer: no chunk lands


@dataclass(frozen=True)
class Ticket:
    """What D needs to pull one offer; small and JSON-serialisable (it travels through Triton)."""

    transfer_id: str  # 32 hex digits, random, never reused
    endpoint: str  # P's control socket path
    lock_path: str  # P's instance lock (held by a live P instance at `endpoint`)
    instance_id: str  # 32 hex digits: the P process that holds the offer
    n_tokens: int
    nbytes: int
    layout_fp: str
    path: str  # data path name (e.g. "host_shm")
    mac: str = ""  # P's signature (transfer/auth.py: sign_ticket), set when its control plane is tcp

    def signing_bytes(self) -> bytes:
        """The canonical bytes P signs: every field but `mac`, sorted keys, compact JSON."""
        fields = {k: v for k, v in asdict(self).items() if k != "mac"}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def __post_init__(self) -> None:
        if not _HEX32.match(self.transfer_id) or not _HEX32.match(self.instance_id):
            raise ValueError("ticket ids must be 32 lowercase hex digits")
        if self.n_tokens <= 0 or self.nbytes <= 0:
            raise ValueError("ticket sizes must be positive")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Ticket:
        try:
            d = json.loads(text)
            return cls(
                transfer_id=str(d["transfer_id"]),
                endpoint=str(d["endpoint"]),
                lock_path=str(d["lock_path"]),
                instance_id=str(d["instance_id"]),
                n_tokens=int(d["n_tokens"]),
                nbytes=int(d["nbytes"]),
                layout_fp=str(d["layout_fp"]),
                path=str(d["path"]),
                mac=str(d.get("mac", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad ticket: {exc}") from exc


@dataclass(frozen=True)
class TransferEvent:
    """One finished transfer (VERIFIED or FAILED on D; COPIED/FAILED/ABORTED/EXPIRED on P).

    Timestamps are `time.time_ns()` (0 when the stage did not happen). P's copy timestamps reach D in
    DONE, so D's event carries all five stages; on the same machine the clocks agree.
    """

    transfer_id: str
    nbytes: int
    state: str  # TransferState or OfferState name
    error: str | None
    path: str
    request_sent_ns: int = 0
    copy_start_ns: int = 0
    copy_end_ns: int = 0
    done_received_ns: int = 0
    verified_ns: int = 0


@dataclass(frozen=True)
class ReceiverStats:
    arena_bytes: int
    free_bytes: int
    in_flight_count: int
    in_flight_bytes: int
    ready_count: int
    quarantined_count: int
    quarantined_bytes: int
    transfers_ok: int
    transfers_failed: int
    verify_ok: int
    verify_mismatch: int
    bytes_moved: int
    aborts_sent: int
    released_by_ack: int
    released_by_done: int
    released_by_refusal: int
    released_by_restart: int
    released_by_gone: int
    released_by_drop: int
    late_chunks_dropped: int = 0  # receiver_writes paths: chunks that came after D forgot the transfer
    drops_sent: int = 0  # DROPs sent: tickets D shed without pulling, P told to end the offer
    drops_refused: int = 0  # `drop()` calls D refused (unattributable ticket, requested, closed, too many)


@dataclass(frozen=True)
class SenderStats:
    offers_open: int
    offers_total: int
    copies_ok: int
    copies_failed: int
    pulls_refused: int
    offers_expired: int
    offers_aborted: int
    bytes_moved: int
    held_acks: int
    acks_sent: int
    connections: int
    auth_failures: int = 0  # TCP control connections that failed the unit-secret handshake
    offers_dropped: int = 0  # ended by a D's DROP (a subset of offers_aborted): pages back before the TTL
    drops_refused: int = 0  # DROPs refused: another instance, no such offer, or already pulled
