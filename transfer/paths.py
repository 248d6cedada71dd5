"""Data paths: how the bytes of one transfer get from P's KV into D's.

A path supplies both halves: D's arena (`create_arena`, exported to P over the control socket) and P's
side (`open_peer_arena`, then per transfer either `alloc_staging` + `copy_to_peer` or `write_rows`).
The sender and receiver own the protocol and never touch memory except through these methods.

Two ways to use an arena (docs/transfer.md):

* **region** — the arena is a receive buffer: P gathers the request's rows into staging, one copy
  crosses into a region of it, D verifies and scatters into its own pool (`copy_to_peer`; every path).
* **direct** — the arena *is* D's KV pool (`LocalArena.pool_view`): P reads its own pool's rows and
  writes them straight into the pages D reserved (`write_rows`; paths with `direct_write`), and D
  verifies the rows in place. No staging, no scatter, one pass over the bytes.

`select_path` probes each candidate with a real small transfer and never falls back silently: with
`require` set, any failure raises `PathUnavailable`; without it, each skipped path is logged as a
warning and the chosen name is what the engine publishes on its info metric.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from tandem.csrc import kv_cuda

from .arena import Region
from .checksum import kv_checksum
from .errors import PathUnavailable, TransferError
from .layout import WireLayout

log = logging.getLogger(__name__)


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


class HostArena(LocalArena):
    """A sealed memfd mapped into D; P maps the same pages from the fd. Dies with its last holder."""

    def __init__(self, nbytes: int, label: str) -> None:
        self.nbytes = nbytes
        self._fd = os.memfd_create(f"tandem-arena-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self._fd, nbytes)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, seals)
            self._mm = mmap.mmap(self._fd, nbytes)
        except OSError:
            os.close(self._fd)
            raise
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)

    def export(self) -> ArenaExport:
        return ArenaExport(meta={"kind": "memfd", "nbytes": self.nbytes}, fds=(self._fd,))

    def region_bytes(self, region: Region) -> torch.Tensor:
        return self._bytes[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        del self._bytes
        # If an engine still holds a view, the mapping goes away with its last reference instead.
        with contextlib.suppress(BufferError):
            self._mm.close()
        os.close(self._fd)


class HostPeerArena(PeerArena):
    def __init__(self, fd: int) -> None:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if not seals & fcntl.F_SEAL_SHRINK:
                # An unsealed file could shrink under a copy and SIGBUS the sender.
                raise TransferError("receive arena memfd is not sealed against shrinking")
            self.nbytes = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, self.nbytes)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._pool: torch.Tensor | None = None

    def pool(self, layout: WireLayout) -> torch.Tensor:
        """D's pool as P sees it (direct mode): the mapping viewed as `layout.staging_shape(S)`."""
        if self._pool is None:
            slots = pool_slots(layout, self.nbytes, "D's")
            self._pool = self.bytes.view(layout.dtype).view(layout.staging_shape(slots))
        return self._pool

    def close(self) -> None:
        self._pool = None
        self.bytes = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(BufferError):
            self._mm.close()


class HostShmPath(TransferPath):
    """Host shared memory: staging (host) -> memfd region, one `copy_` crosses. CPU engines and tests."""

    name = "host_shm"
    direct_write = True

    def probe(self) -> None:
        try:
            arena = self.create_arena(2 * mmap.PAGESIZE, "probe")
            try:
                exp = arena.export()
                peer = self.open_peer_arena(exp.meta, [os.dup(exp.fds[0])])
                layout = WireLayout(1, 1, 8, "float32")
                staging = self.alloc_staging(layout, 16)
                staging.copy_(torch.randn(staging.shape))
                region = Region(offset=mmap.PAGESIZE, nbytes=staging.numel() * 4, alloc_bytes=mmap.PAGESIZE)
                self.copy_to_peer(staging, peer, region.offset)
                got = kv_checksum(arena.region_bytes(region))
                peer.close()
                if got != kv_checksum(staging):
                    raise PathUnavailable("host_shm probe: bytes differ after the copy")
            finally:
                arena.close()
        except PathUnavailable:
            raise
        except Exception as exc:
            raise PathUnavailable(f"host_shm probe failed: {exc!r}") from exc

    def create_arena(self, nbytes: int, label: str) -> LocalArena:
        return HostArena(nbytes, label)

    def open_peer_arena(self, meta: Mapping[str, object], fds: list[int]) -> PeerArena:
        if meta.get("kind") != "memfd" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise TransferError(f"host_shm expects one memfd, got meta={dict(meta)} and {len(fds)} fds")
        return HostPeerArena(fds[0])

    def alloc_staging(self, layout: WireLayout, n_tokens: int) -> torch.Tensor:
        return torch.empty(layout.staging_shape(n_tokens), dtype=layout.dtype)

    def copy_to_peer(self, staging: torch.Tensor, peer: PeerArena, offset: int, tid: str = "") -> None:
        assert isinstance(peer, HostPeerArena)
        src = staging.reshape(-1).view(torch.uint8)
        if offset < 0 or offset + src.numel() > peer.nbytes:
            raise TransferError(f"copy of {src.numel()} bytes at {offset} outside {peer.nbytes} bytes")
        peer.bytes[offset : offset + src.numel()].copy_(src)

    def write_rows(
        self,
        layout: WireLayout,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        peer: PeerArena,
        dst_slots: torch.Tensor,
    ) -> int | None:
        assert isinstance(peer, HostPeerArena)
        dst = peer.pool(layout)
        if src.device.type != "cpu":  # a GPU P: bring only this request's rows to the host
            src = src.index_select(2, src_slots).cpu()
            src_slots = torch.arange(src.shape[2])
        kv_cuda.gather_write(src, src_slots, dst, dst_slots.cpu(), check_bounds=False)
        return None


def select_path(
    preferred: Sequence[str],
    require: str | None,
    registry: Mapping[str, Callable[[], TransferPath]],
) -> TransferPath:
    """Probe paths and return the first that works. Called once per process at engine start.

    With `require`, only that path is probed and any failure raises `PathUnavailable`. Without it the
    candidates are probed in `preferred` order; each failure is logged as a warning (never silent) and
    `PathUnavailable` lists every reason if none works.
    """
    reg = registry
    names = [require] if require is not None else list(preferred)
    reasons: list[str] = []
    for name in names:
        factory = reg.get(name)
        if factory is None:
            reasons.append(f"{name}: not a known path ({sorted(reg)})")
            continue
        path = factory()
        try:
            path.probe()
        except PathUnavailable as exc:
            reasons.append(f"{name}: {exc}")
            if require is None:
                log.warning("transfer path %s unavailable, trying the next: %s", name, exc)
            continue
        if reasons:
            log.warning("transfer path %s chosen after skipping: %s", name, "; ".join(reasons))
        return path
    raise PathUnavailable("no transfer path works: " + "; ".join(reasons or ["no candidates"]))
