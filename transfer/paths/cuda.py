"""GPU data paths: D's receive arena is device memory that P's GPU writes directly over NVLink.

Both paths keep the protocol and the copy design of the host path: P gathers the request's rows into
one contiguous staging tensor on its GPU, exactly one copy crosses into D's region, D scatters from
the region into its own pages (docs/transfer.md). They differ only in how D's memory is shared:

* `cuda_ipc` — D's arena is one `cudaMalloc` buffer; its legacy IPC handle (64 bytes, hex in the
  HELLO meta, no fds) is opened by P with `cudaIpcOpenMemHandle` (peer access enabled lazily) and
  written with `cudaMemcpyAsync` on a dedicated stream. Measured at NVLink speed (docs/transfer.md); not
  torch.multiprocessing's sharing, which ran 10x slower. Needs P to see D's GPU.
* `cuda_vmm` — D's arena is `cuMemCreate` memory, exported as a FABRIC handle when a real FABRIC
  allocation succeeds (needs an IMEX channel; the "supported" attribute is not trusted), else as a
  POSIX fd passed in HELLO with SCM_RIGHTS. P imports it, maps it with `cuMemMap` and grants its own
  device access with `cuMemSetAccess`. `CudaVmmPath.handle_type` reports which one is in use.

`copy_to_peer` returns only after the copy stream was synchronised, so DONE/FAILED/ABORT_ACK keep
meaning "no byte can still land". `probe()` does a real transfer into a child process on another GPU
plus a bandwidth self-test and raises `PathUnavailable` with the reason (not built, no CUDA, handle
refused, bytes differ, bandwidth under `min_gbps`). `registry.py` builds them by name.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Callable, Mapping

import torch

from ..arena import Region
from ..checksum import rows_checksum_from_lanes
from ..errors import PathUnavailable, TransferError
from ..layout import WireLayout
from ._gpu import (
    CopyStream,
    DeviceBuffer,
    check_range,
    check_staging,
    current_device,
    kernels,
    probe_transfer,
)
from .base import ArenaExport, LocalArena, PeerArena, TransferPath, pool_slots

DEFAULT_MIN_GBPS = 100.0  # NVLink4 copies run ~390 GB/s; PCIe 5 tops out near 50, torch sharing ran 38


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _meta_int(meta: Mapping[str, object], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TransferError(f"arena meta field {key!r} must be a non-negative int, got {value!r}")
    return value


def _meta_hex(meta: Mapping[str, object], key: str, nbytes: int) -> bytes:
    value = meta.get(key)
    try:
        raw = bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        raw = b""
    if len(raw) != nbytes:
        raise TransferError(f"arena meta field {key!r} must be {nbytes} bytes of hex, got {value!r}")
    return raw


class GpuArena(LocalArena):
    """D's arena on `cuda:<device>`: a `DeviceBuffer` plus the export P needs (fds owned here)."""

    def __init__(
        self, buf: DeviceBuffer, nbytes: int, meta: dict[str, int | str], fds: tuple[int, ...]
    ) -> None:
        self.nbytes = nbytes
        self.device = buf.device
        self._buf: DeviceBuffer | None = buf
        self._view = buf.tensor()[:nbytes]
        self._meta = meta
        self._fds = fds

    @property
    def ptr(self) -> int:
        assert self._buf is not None, "arena closed"
        return self._buf.ptr

    def export(self) -> ArenaExport:
        return ArenaExport(meta=dict(self._meta), fds=self._fds)

    def region_bytes(self, region: Region) -> torch.Tensor:
        return self._view[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        """The memory itself is freed when the last view of it dies (an engine may still hold one)."""
        self._view = torch.empty(0, dtype=torch.uint8)
        self._buf = None
        _close_fds(list(self._fds))
        self._fds = ()


class MappedPeer(PeerArena):
    """P's mapping of one D arena: a pointer valid on P's device, unmapped once by `close` or GC."""

    def __init__(self, ptr: int, nbytes: int, device: int, unmap: Callable[[], None], describe: str) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self.describe = describe
        self._unmap: Callable[[], None] | None = unmap
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            unmap, self._unmap = self._unmap, None
        if unmap is not None:
            with contextlib.suppress(Exception):
                unmap()

    def __del__(self) -> None:
        self.close()


class _GpuPath(TransferPath):
    """What both direct paths share: P's staging, the crossing copy, the probe."""

    _child_kind = ""
    direct_write = True
    arena_device = "cuda"

    def __init__(self, device: int | None = None, min_gbps: float = DEFAULT_MIN_GBPS) -> None:
        """`device`: this process's GPU (default: torch's current device, resolved on first use).
        `min_gbps`: the probe refuses the path below this crossing bandwidth."""
        self._device = device
        self.min_gbps = min_gbps
        self.probe_gbps: float | None = None
        self._copies = CopyStream()

    @property
    def device(self) -> int:
        if self._device is None:
            self._device = current_device()
        return self._device

    def alloc_staging(self, layout: WireLayout, n_tokens: int) -> torch.Tensor:
        return torch.empty(
            layout.staging_shape(n_tokens), dtype=layout.dtype, device=torch.device("cuda", self.device)
        )

    def copy_to_peer(self, staging: torch.Tensor, peer: PeerArena, offset: int, tid: str = "") -> None:
        if not isinstance(peer, MappedPeer):
            raise TransferError(f"{self.name} cannot write a {type(peer).__name__}")
        nbytes = check_staging(staging, self.device)
        check_range(offset, nbytes, peer.nbytes)
        try:
            self._copies.copy(peer.ptr + offset, staging)
        except RuntimeError as exc:
            raise TransferError(f"{self.name} copy into {peer.describe} failed: {exc}") from exc

    def write_rows(
        self,
        layout: WireLayout,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        peer: PeerArena,
        dst_slots: torch.Tensor,
    ) -> int | None:
        """One fused kernel on P's GPU reads P's rows and writes D's pages through the mapping (NVLink
        stores, no staging, no copy engine), hashing each vector it stores (so P's checksum costs no
        pass of its own); on the path's copy stream, synchronised before returning. Returns that
        checksum (None for rows not a multiple of 8 bytes: the plain kernel ran, the caller hashes).
        The mapping is passed as a raw pointer: a torch view of it could be placed on D's device (the
        pointer's home) and silently copied."""
        if not isinstance(peer, MappedPeer):
            raise TransferError(f"{self.name} cannot write a {type(peer).__name__}")
        dev = self.device
        want = layout.staging_shape(src.shape[2]) if src.dim() == 5 else None
        if not src.is_cuda or src.device.index != dev or tuple(src.shape) != want or not src.is_contiguous():
            raise TransferError(f"source rows must be a contiguous [L, 2, S, kvh, hd] pool on cuda:{dev}")
        if src.dtype != layout.dtype:
            raise TransferError(f"source rows are {src.dtype}, the layout says {layout.dtype}")
        for name, t in (("src_slots", src_slots), ("dst_slots", dst_slots)):
            if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous() or t.device != src.device:
                raise TransferError(f"{name} must be contiguous int64 [T] on {src.device}")
        if src_slots.numel() != dst_slots.numel():
            raise TransferError(f"{src_slots.numel()} source slots, {dst_slots.numel()} destination slots")
        dst_rows = pool_slots(layout, peer.nbytes, f"{peer.describe}:")
        num_lt = layout.num_layers * 2
        row_bytes = layout.token_bytes // num_lt
        hashed = (src.data_ptr() | peer.ptr | row_bytes) % 8 == 0
        lanes = torch.empty(3, dtype=torch.int64, device=src.device) if hashed else None
        k = kernels()

        def launch() -> None:
            stream = torch.cuda.current_stream(src.device).cuda_stream
            src_rows = (src.data_ptr(), src.shape[2], src_slots.data_ptr())
            dst = (peer.ptr, dst_rows, dst_slots.data_ptr())
            shape = (num_lt, src_slots.numel(), row_bytes)
            if lanes is None:
                k.gather_write(*src_rows, *dst, *shape, dev, stream)
            else:
                k.gather_write_checksum(*src_rows, *dst, *shape, lanes.data_ptr(), dev, stream)

        try:
            self._copies.run(dev, launch)
        except RuntimeError as exc:
            raise TransferError(f"{self.name} write into {peer.describe} failed: {exc}") from exc
        return None if lanes is None else rows_checksum_from_lanes(lanes, src, src_slots.numel())

    def probe(self) -> None:
        kernels()
        self.probe_gbps = probe_transfer(
            self.name,
            self._child_kind,
            self.device,
            lambda meta, fds: self.open_peer_arena(meta, fds),
            self.copy_to_peer,
            lambda peer: peer.close(),
            self.min_gbps,
        )


class CudaIpcPath(_GpuPath):
    """Legacy CUDA IPC: cudaMalloc'd arena, 64-byte handle in the HELLO meta, cudaMemcpyAsync from P."""

    name = "cuda_ipc"
    _child_kind = "cuda_ipc"

    def create_arena(self, nbytes: int, label: str) -> LocalArena:
        k = kernels()
        dev = self.device
        ptr = k.malloc(dev, nbytes)
        buf = DeviceBuffer(ptr, nbytes, dev, lambda: k.free(dev, ptr))
        meta: dict[str, int | str] = {
            "kind": "cuda_ipc",
            "nbytes": nbytes,
            "handle": k.ipc_get_handle(dev, ptr).hex(),
            "pid": os.getpid(),
            "nonce": secrets.token_hex(8),
            "label": label,
        }
        return GpuArena(buf, nbytes, meta, ())

    def open_peer_arena(self, meta: Mapping[str, object], fds: list[int]) -> PeerArena:
        _close_fds(fds)  # this path passes no fds; never leak any that came along
        if meta.get("kind") != "cuda_ipc":
            raise TransferError(f"cuda_ipc expects a cuda_ipc arena, got meta kind {meta.get('kind')!r}")
        nbytes, pid = _meta_int(meta, "nbytes"), _meta_int(meta, "pid")
        handle = _meta_hex(meta, "handle", 64)
        if pid == os.getpid():
            raise TransferError(
                "cuda_ipc: the arena was exported by this process; IPC handles cross processes only"
            )
        k = kernels()
        dev = self.device
        try:
            ptr = k.ipc_open_handle(dev, handle)
        except RuntimeError as exc:
            raise TransferError(
                f"cuda_ipc: cannot open D's IPC handle (pid {pid}) on cuda:{dev}: {exc}. The exporting "
                "process may have exited or restarted, or this process cannot see D's GPU"
            ) from exc
        return MappedPeer(ptr, nbytes, dev, lambda: k.ipc_close_handle(dev, ptr), f"D pid {pid} (cuda_ipc)")


class CudaVmmPath(_GpuPath):
    """CUDA VMM: cuMemCreate'd arena exported as FABRIC (if a real allocation works) or a POSIX fd."""

    name = "cuda_vmm"

    def __init__(
        self, device: int | None = None, min_gbps: float = DEFAULT_MIN_GBPS, allow_fabric: bool = True
    ) -> None:
        super().__init__(device, min_gbps)
        self._allow_fabric = allow_fabric
        self._handle_type: str | None = None
        self.fabric_refused: str | None = None  # why FABRIC was not used, for logs

    @property
    def handle_type(self) -> str:
        """`fabric` or `posix_fd`: decided once by a real FABRIC allocation (the attribute lies)."""
        if self._handle_type is None:
            k = kernels()
            dev = self.device
            self._handle_type = "posix_fd"
            if not self._allow_fabric:
                self.fabric_refused = "disabled by configuration"
            else:
                try:
                    h = k.vmm_create(dev, k.vmm_granularity(dev, True), True)
                    try:
                        k.vmm_export_fabric(h)
                    finally:
                        k.vmm_release(h)
                    self._handle_type = "fabric"
                except RuntimeError as exc:
                    self.fabric_refused = str(exc)
        return self._handle_type

    @property
    def _child_kind(self) -> str:  # type: ignore[override]
        return "vmm_" + self.handle_type

    def create_arena(self, nbytes: int, label: str) -> LocalArena:
        k = kernels()
        dev, htype = self.device, self.handle_type
        fabric = htype == "fabric"
        gran = k.vmm_granularity(dev, fabric)
        size = -(-nbytes // gran) * gran
        h = k.vmm_create(dev, size, fabric)
        fds: tuple[int, ...] = ()
        try:
            ptr = k.vmm_map(h, size, [dev])
            meta: dict[str, int | str] = {
                "kind": "cuda_vmm",
                "handle_type": htype,
                "nbytes": nbytes,
                "size": size,
                "pid": os.getpid(),
                "label": label,
            }
            if fabric:
                meta["handle"] = k.vmm_export_fabric(h).hex()
            else:
                fds = (k.vmm_export_fd(h),)
        except BaseException:
            k.vmm_release(h)
            raise

        def release() -> None:
            k.vmm_unmap(ptr, size)
            k.vmm_release(h)

        return GpuArena(DeviceBuffer(ptr, size, dev, release), nbytes, meta, fds)

    def open_peer_arena(self, meta: Mapping[str, object], fds: list[int]) -> PeerArena:
        try:
            if meta.get("kind") != "cuda_vmm":
                raise TransferError(f"cuda_vmm expects a cuda_vmm arena, got meta kind {meta.get('kind')!r}")
            nbytes, size = _meta_int(meta, "nbytes"), _meta_int(meta, "size")
            if nbytes > size:
                raise TransferError(f"cuda_vmm arena claims {nbytes} bytes in a {size}-byte mapping")
            k = kernels()
            htype = meta.get("handle_type")
            try:
                if htype == "posix_fd":
                    if len(fds) != 1:
                        raise TransferError(f"cuda_vmm posix_fd arena needs exactly one fd, got {len(fds)}")
                    h = k.vmm_import_fd(fds[0])
                elif htype == "fabric":
                    h = k.vmm_import_fabric(_meta_hex(meta, "handle", 64))
                else:
                    raise TransferError(f"cuda_vmm: unknown handle_type {htype!r}")
            except RuntimeError as exc:
                raise TransferError(f"cuda_vmm: cannot import D's {htype} handle: {exc}") from exc
        finally:
            _close_fds(fds)
        dev = self.device
        try:
            ptr = k.vmm_map(h, size, [dev])
        except RuntimeError as exc:
            k.vmm_release(h)
            raise TransferError(f"cuda_vmm: cannot map D's arena for cuda:{dev}: {exc}") from exc

        def unmap() -> None:
            k.vmm_unmap(ptr, size)
            k.vmm_release(h)

        return MappedPeer(ptr, nbytes, dev, unmap, f"D pid {meta.get('pid')} (cuda_vmm/{htype})")


__all__ = [
    "DEFAULT_MIN_GBPS",
    "CudaIpcPath",
    "CudaVmmPath",
    "GpuArena",
    "MappedPeer",
    "PathUnavailable",
]
