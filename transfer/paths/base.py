"""The path contract: what every data path supplies, and what the sender and receiver may assume of it.

A path supplies both halves: D's arena (`create_arena`, exported to P over the control socket) and P's
side (`open_peer_arena`, then per transfer either `alloc_staging` + `copy_to_peer` or `write_rows`).
The sender and receiver own the protocol and never touch memory except through these methods.

Two ways to use an arena (docs/transfer.md):

* **region** — the arena is a receive buffer: P gathers the request's rows into staging, one copy
  crosses into a region of it, D verifies and scatters into its own pool (`copy_to_peer`; every path).
* **direct** — the arena *is* D's KV pool (`LocalArena.pool_view`): P reads its own pool's rows and
  writes them straight into the pages D reserved (`write_rows`; paths with `direct_write`), and D
  verifies the rows in place. No staging, no scatter, one pass over the bytes.

The paths themselves live one per module beside this one (`host_shm`, `cuda`, `proxy`, `tcp`);
`registry` builds one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..arena import Region
from ..errors import TransferError
from ..layout import WireLayout


def pool_slots(layout: WireLayout, nbytes: int, whose: str = "the") -> int:
    """Direct mode: how many slots (tokens) an arena of `nbytes` holds as D's KV pool. Raises
    `TransferError` unless it is a positive whole number of `layout.token_bytes`: every side that views
    or writes D's pool (D's receiver, P's peer mapping, the sidecar's request) asks here."""
    slots, rest = divmod(nbytes, layout.token_bytes)
    if rest or slots <= 0:
        raise TransferError(f"{whose} {nbytes}-byte arena is not a pool of {layout.token_bytes}-byte slots")
    return slots


@dataclass(frozen=True)
class ArenaExport:
    """What D sends P in HELLO so P can write D's arena: JSON metadata plus fds (still owned by D)."""

    meta: dict[str, int | str] = field(default_factory=dict)
    fds: tuple[int, ...] = ()


class LocalArena(ABC):
    """D's receive arena. Owned by the receiver; lives until `TransferReceiver.close()`."""

    nbytes: int

    @abstractmethod
    def export(self) -> ArenaExport:
        """Called once per control connection (in HELLO). The fds stay owned by the arena."""

    @abstractmethod
    def region_bytes(self, region: Region) -> torch.Tensor:
        """uint8 view of the region's first `region.nbytes` bytes (no copy); valid until it is freed."""

    def expect(self, region: Region, tid: str) -> None:  # noqa: B027 - a no-op hook, not abstract
        """Called by the receiver just before the PULL for `tid` leaves D: `region` now belongs to that
        transfer. Only paths whose receiver writes every byte itself (`receiver_writes`) act on it."""

    def forget(self, region: Region) -> None:  # noqa: B027 - a no-op hook, not abstract
        """Called by the receiver before `region` goes back to the allocator (for every region, on every
        path). With `receiver_writes` it must return only when no byte of the transfer that `region`
        was expecting can still land; elsewhere a no-op."""

    def late_chunks_dropped(self) -> int:
        """With `receiver_writes`: chunks that arrived for a transfer D no longer expected (after
        `forget`) and were dropped, since the arena was created. Any thread; 0 on other paths."""
        return 0

    def pool_view(self, layout: WireLayout) -> torch.Tensor:
        """Direct mode: the whole arena as D's KV pool, `layout.staging_shape(S)` with S slots (the
        arena holds exactly S tokens). A view, no copy; D's engine builds its pool on it."""
        slots = pool_slots(layout, self.nbytes)
        raw = self.region_bytes(Region(offset=0, nbytes=self.nbytes, alloc_bytes=self.nbytes))
        return raw.view(layout.dtype).view(layout.staging_shape(slots))

    @abstractmethod
    def close(self) -> None:
        """Called once by the receiver's `close()` after every region was freed or abandoned."""


class PeerArena(ABC):
    """P's mapping of one D's arena; one per control connection, dropped when the last copy into it ends."""

    nbytes: int

    @abstractmethod
    def close(self) -> None: ...


class TransferPath(ABC):
    """One way of moving bytes P -> D. Instances are stateless apart from configuration."""

    name: str
    receiver_writes: bool = False
    """True when D itself writes every byte (it receives chunks and copies them into its arena) and
    drops chunks of a transfer once `LocalArena.forget` returned. Then `forget` is this path's own proof:
    D frees a failed transfer's region at once (`ReleaseReason.RECEIVER_DROPS`) instead of quarantining
    it. False when P writes D's memory directly (host_shm, the GPU paths, the proxy)."""

    direct_write: bool = False
    """True when P can write D's KV pool itself (`write_rows`): the receiver may then run in direct mode
    (the arena is D's pool, PULL_ROWS names D's slots)."""
    arena_device: str = "cpu"
    """Where D's arena lives ("cpu" or "cuda"): direct mode needs D's engine on that device type."""

    @abstractmethod
    def probe(self) -> None:
        """Do a real small transfer through this path; raise `PathUnavailable` if anything fails."""

    @abstractmethod
    def create_arena(self, nbytes: int, label: str) -> LocalArena:
        """D side, once per receiver."""

    @abstractmethod
    def open_peer_arena(self, meta: Mapping[str, object], fds: list[int]) -> PeerArena:
        """P side, once per HELLO. Takes ownership of `fds` (closes them whatever happens)."""

    @abstractmethod
    def alloc_staging(self, layout: WireLayout, n_tokens: int) -> torch.Tensor:
        """P side, once per copy: a contiguous tensor of `layout.staging_shape(n_tokens)` for `gather`."""

    @abstractmethod
    def copy_to_peer(self, staging: torch.Tensor, peer: PeerArena, offset: int, tid: str = "") -> None:
        """P side, once per copy, on a copy worker: one copy of all of `staging` into the peer at
        `offset`, for transfer `tid` (the sender always passes it; probes and benchmarks outside the
        protocol may omit it, and paths that P writes directly ignore it). Must return only when no
        byte of it can still land (synchronise async engines)."""

    def write_rows(
        self,
        layout: WireLayout,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        peer: PeerArena,
        dst_slots: torch.Tensor,
    ) -> int | None:
        """P side, direct mode, once per copy on a copy worker: write rows `src[:, :, src_slots]` (P's
        pool, or a staging tensor with `src_slots = arange(T)`) into D's pool (the peer arena viewed as
        `layout.staging_shape(S)`) at `dst_slots`. Both slot tensors are int64 on `src`'s device; the
        sender checked `dst_slots` against S. Ordered after the caller's current stream; returns only
        when no byte of it can still land (like `copy_to_peer`). Returns `kv_checksum_rows(src,
        src_slots)` when the path hashed the rows on the way (the GPU paths' fused kernel), else None
        (the sender hashes them itself; P's rows do not change)."""
        raise TransferError(f"the {self.name} path cannot write D's pool directly")

    def source_storage(self, layout: WireLayout, n_slots: int) -> torch.Tensor | None:
        """P side, once at engine start: memory for P's own KV pool (`layout.staging_shape(n_slots)`)
        when this path must know it in advance to write from it (the proxy registers it with the
        sidecar), else None (P allocates its pool itself)."""
        return None

    def share_instance_lock(self, fd: int | None) -> None:
        """P side, by `TransferSender`: with the slot's instance-lock fd right after `start` took the
        lock (the fd stays owned by the sender), and with None in `close` once every copy finished,
        just before the sender lets go of it. A path whose bytes a third process writes for P (the
        proxy) must keep the lock held there for as long as such a write can land, so that P's death
        alone never looks like proof to D. Paths where P itself writes ignore it."""
        return None
