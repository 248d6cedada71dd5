"""The host shared-memory path (`host_shm`): D's arena is a sealed memfd that P maps.

Region mode: one `copy_` of P's staging into the mapped region. Direct mode: the arena is D's pool and
P writes a request's rows into D's pages with `kv_cuda.gather_write` (a GPU P brings only those rows to
the host first). The path of CPU engines and of the tests; every host has it.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Mapping

import torch

from tandem.csrc import kv_cuda

from ..arena import Region
from ..checksum import kv_checksum
from ..errors import PathUnavailable, TransferError
from ..layout import WireLayout
from .base import ArenaExport, LocalArena, PeerArena, TransferPath, pool_slots


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
