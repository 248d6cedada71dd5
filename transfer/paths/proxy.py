"""The `proxy` TransferPath: P and D each see only their own GPU; the unit's sidecar copies between them.

D's arena is a cudaMalloc buffer registered with the proxy (`transfer/paths/proxy_sidecar.py`); the HELLO meta
carries only its registration id, so no fd or handle reaches P. P's staging comes from a small pool
of buffers registered once each (an IPC open costs far more than a copy, so never per transfer);
`copy_to_peer` waits for the gather on P's stream, asks the proxy to copy, and returns only on its
reply — which the proxy sends after its copy stream synchronised.

Direct mode (D's arena is its KV pool): P's own pool is allocated here too (`source_storage`) and
registered once, so `write_rows` just names the registrations and the slot runs; the sidecar runs the
fused row kernel between the two mappings and replies after it finished.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Mapping

import torch

from ..arena import Region
from ..checksum import kv_checksum
from ..control import DEFAULT_UNIT
from ..errors import PathUnavailable, TransferError
from ..layout import WireLayout
from ._gpu import DeviceBuffer, check_range, check_staging, current_device, kernels
from .base import LocalArena, PeerArena, TransferPath, pool_slots
from .cuda import DEFAULT_MIN_GBPS, GpuArena
from .proxy_sidecar import ProxyClient, encode_slots, proxy_socket_path

_SLAB_ALIGN = 2 << 20


class ProxyPeer(PeerArena):
    """P's reference to D's arena: just its registration id at the proxy (nothing is mapped in P)."""

    def __init__(self, arena_id: str, nbytes: int) -> None:
        self.arena_id = arena_id
        self.nbytes = nbytes

    def close(self) -> None:
        pass


class _Slab:
    def __init__(self, ptr: int, nbytes: int, reg_id: str) -> None:
        self.ptr, self.nbytes, self.reg_id = ptr, nbytes, reg_id


class ProxyPath(TransferPath):
    name = "proxy"
    arena_device = "cuda"

    def __init__(
        self,
        unit: str | None = None,
        device: int | None = None,
        layout: WireLayout | None = None,
        min_gbps: float = DEFAULT_MIN_GBPS,
        socket_name: str = "proxy",
        direct: bool = False,
    ) -> None:
        """`unit`: the sidecar's (`tandem-proxy --unit`), `DEFAULT_UNIT` if None; `layout`, when given, is
        sent with every registration so the proxy refuses a P or D of another layout with a clear error.

        `direct=True` offers direct mode (the sidecar's fused kernel writes D's pool from P's
        registered pool). Off by default: on 2x H200 it took 1.49-1.51 ms for 288 MiB against 1.34-1.46
        ms for gather + the sidecar's copy-engine copy + scatter (docs/transfer.md), the request path
        through the sidecar costing more than the two local passes it saves."""
        self.direct_write = direct
        self.unit = unit or DEFAULT_UNIT
        self._device = device
        self.layout = layout
        self.min_gbps = min_gbps
        self.socket_name = socket_name
        self.probe_gbps: float | None = None
        self._lock = threading.Lock()
        self._owner: ProxyClient | None = None  # holds the staging registrations
        self._local = threading.local()  # one request connection per copy worker thread
        self._clients: list[ProxyClient] = []  # every request connection, closed by close()
        self._lock_fd: int | None = None  # P's instance lock, handed to the proxy on each connection
        self._free: list[_Slab] = []
        self._busy: dict[int, _Slab] = {}
        self._pools: dict[int, _Slab] = {}  # P's pools (direct mode), by base pointer

    @property
    def device(self) -> int:
        if self._device is None:
            self._device = current_device()
        return self._device

    @property
    def socket_path(self) -> str:
        return proxy_socket_path(self.unit, self.socket_name)

    def _fp(self) -> str | None:
        return None if self.layout is None else self.layout.fingerprint()

    def share_instance_lock(self, fd: int | None) -> None:
        """With an fd: every request connection opened from now on first hands the proxy a copy of P's
        lock (see `proxy_sidecar.py`): copies are requested there, so the proxy keeps P's lock held
        until it has finished them, even if P dies mid-copy. With None (the sender is closing, every
        copy finished): close the request connections, so the proxy lets go of the lock."""
        with self._lock:
            self._lock_fd = fd
            clients = self._clients if fd is None else []
            if fd is None:
                self._clients = []
        for c in clients:
            c.close()

    def _client(self) -> ProxyClient:
        """This thread's request connection; a new one when the lock was shared after it was opened
        (the startup probe's) or dropped since (closed)."""
        c: ProxyClient | None = getattr(self._local, "client", None)
        lock_fd = self._lock_fd
        if c is not None and not c.closed and (lock_fd is None or self._local.holds):
            return c
        if c is not None:
            c.close()
        c = ProxyClient(self.socket_path)
        if lock_fd is not None:
            try:
                c.request(op="hold_lock", fds=(lock_fd,))
            except BaseException:
                c.close()
                raise
        self._local.client, self._local.holds = c, lock_fd is not None
        with self._lock:
            self._clients.append(c)
        return c

    def _register(self, client: ProxyClient, role: str, ptr: int, nbytes: int) -> str:
        k = kernels()
        reply = client.request(
            op="register",
            role=role,
            handle=k.ipc_get_handle(self.device, ptr).hex(),
            nbytes=nbytes,
            bus_id=k.pci_bus_id(self.device),
            layout_fp=self._fp(),
            pid=os.getpid(),
        )
        return str(reply["id"])

    # ---- D side --------------------------------------------------------------------------------------

    def create_arena(self, nbytes: int, label: str) -> LocalArena:
        k = kernels()
        dev = self.device
        ptr = k.malloc(dev, nbytes)
        try:
            client = ProxyClient(self.socket_path)
            arena_id = self._register(client, "arena", ptr, nbytes)
        except BaseException:
            k.free(dev, ptr)
            raise

        def release() -> None:
            client.close()  # the proxy unregisters (waiting for its copies) when the connection closes
            time.sleep(0)  # let the proxy thread run; cudaFree below is still safe: its mapping pins it
            k.free(dev, ptr)

        meta: dict[str, int | str] = {"kind": "proxy", "nbytes": nbytes, "arena_id": arena_id}
        meta["proxy"] = self.socket_path
        meta["label"] = label
        return GpuArena(DeviceBuffer(ptr, nbytes, dev, release), nbytes, meta, ())

    # ---- P side --------------------------------------------------------------------------------------

    def open_peer_arena(self, meta: Mapping[str, object], fds: list[int]) -> PeerArena:
        for fd in fds:
            os.close(fd)
        if meta.get("kind") != "proxy":
            raise TransferError(f"proxy path expects a proxy arena, got meta kind {meta.get('kind')!r}")
        if meta.get("proxy") != self.socket_path:
            raise TransferError(
                f"D registered with proxy {meta.get('proxy')!r}, this P uses {self.socket_path!r}"
            )
        nbytes, arena_id = meta.get("nbytes"), meta.get("arena_id")
        if not isinstance(nbytes, int) or not isinstance(arena_id, str):
            raise TransferError(f"bad proxy arena meta {dict(meta)!r}")
        return ProxyPeer(arena_id, nbytes)

    def alloc_staging(self, layout: WireLayout, n_tokens: int) -> torch.Tensor:
        """A view into a registered slab; the slab returns to the pool when the tensor is freed."""
        need = layout.staging_nbytes(n_tokens)
        with self._lock:
            fits = [s for s in self._free if s.nbytes >= need]
            slab = min(fits, key=lambda s: s.nbytes) if fits else None
            if slab is not None:
                self._free.remove(slab)
        if slab is None:
            k = kernels()
            size = -(-need // _SLAB_ALIGN) * _SLAB_ALIGN
            ptr = k.malloc(self.device, size)
            with self._lock:
                if self._owner is None:
                    self._owner = ProxyClient(self.socket_path)
                owner = self._owner
            try:
                slab = _Slab(ptr, size, self._register(owner, "staging", ptr, size))
            except BaseException:
                k.free(self.device, ptr)
                raise
        with self._lock:
            self._busy[slab.ptr] = slab
        buf = DeviceBuffer(slab.ptr, need, self.device, functools.partial(self._give_back, slab))
        return buf.tensor().view(layout.dtype).view(layout.staging_shape(n_tokens))

    def _give_back(self, slab: _Slab) -> None:
        with self._lock:
            self._busy.pop(slab.ptr, None)
            self._free.append(slab)

    def copy_to_peer(self, staging: torch.Tensor, peer: PeerArena, offset: int, tid: str = "") -> None:
        if not isinstance(peer, ProxyPeer):
            raise TransferError(f"proxy path cannot write a {type(peer).__name__}")
        nbytes = check_staging(staging, self.device)
        check_range(offset, nbytes, peer.nbytes)
        with self._lock:
            slab = self._busy.get(staging.data_ptr())
        if slab is None:
            raise TransferError("proxy path: staging must come from this path's alloc_staging")
        torch.cuda.current_stream(staging.device).synchronize()  # the proxy cannot wait on our stream
        self._client().request(
            op="copy", src=slab.reg_id, src_offset=0, dst=peer.arena_id, dst_offset=offset, nbytes=nbytes
        )

    def source_storage(self, layout: WireLayout, n_slots: int) -> torch.Tensor:
        """P's KV pool in memory the proxy can read: allocated and registered once (role "pool"),
        kept for the process's life (the engine's pool lives as long)."""
        k = kernels()
        nbytes = layout.staging_nbytes(n_slots)
        ptr = k.malloc(self.device, nbytes)
        with self._lock:
            if self._owner is None:
                self._owner = ProxyClient(self.socket_path)
            owner = self._owner
        try:
            slab = _Slab(ptr, nbytes, self._register(owner, "pool", ptr, nbytes))
        except BaseException:
            k.free(self.device, ptr)
            raise
        with self._lock:
            self._pools[ptr] = slab
        buf = DeviceBuffer(ptr, nbytes, self.device, lambda: None)  # registered for good: never freed
        return buf.tensor().view(layout.dtype).view(layout.staging_shape(n_slots))

    def write_rows(
        self,
        layout: WireLayout,
        src: torch.Tensor,
        src_slots: torch.Tensor,
        peer: PeerArena,
        dst_slots: torch.Tensor,
    ) -> int | None:
        """The sidecar writes D's pool from P's registered pool (or a staging slab) with the fused row
        kernel; returns on its reply, sent after the kernel finished. None: the sender hashes P's rows."""
        if not isinstance(peer, ProxyPeer):
            raise TransferError(f"proxy path cannot write a {type(peer).__name__}")
        with self._lock:
            slab = self._pools.get(src.data_ptr()) or self._busy.get(src.data_ptr())
        if slab is None or not src.is_contiguous():
            raise TransferError(
                "proxy path: source rows must be in the pool from source_storage or a staging slab"
            )
        dst_rows = pool_slots(layout, peer.nbytes, "D's")
        num_lt = layout.num_layers * 2
        row_bytes = layout.token_bytes // num_lt
        host = torch.cat([src_slots, dst_slots]).to(torch.int32).cpu().numpy()  # waits for P's stream too
        n = src_slots.numel()
        torch.cuda.current_stream(src.device).synchronize()  # the proxy cannot wait on our stream
        self._client().request(
            op="write_rows",
            src=slab.reg_id,
            src_slots=encode_slots(host[:n]),
            src_rows=src.shape[2],
            dst=peer.arena_id,
            dst_slots=encode_slots(host[n:]),
            dst_rows=dst_rows,
            num_lt=num_lt,
            row_bytes=row_bytes,
        )
        return None

    def probe(self) -> None:
        """Ping the proxy, then move 64 MiB through it into an arena of our own, timed and verified."""
        try:
            kernels()
            self._client().request(op="ping")
            layout = self.layout or WireLayout(1, 1, 64, "bfloat16")
            n_tokens = max(1, (64 << 20) // layout.token_bytes)
            staging = self.alloc_staging(layout, n_tokens)
            flat = staging.view(torch.uint8).reshape(-1)
            flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, device=staging.device))
            nbytes = staging.numel() * staging.element_size()
            arena = self.create_arena(nbytes, "probe")
            try:
                exp = arena.export()
                peer = self.open_peer_arena(exp.meta, [])
                self.copy_to_peer(staging, peer, 0)
                t0 = time.perf_counter()
                for _ in range(10):
                    self.copy_to_peer(staging, peer, 0)
                gbps = nbytes * 10 / (time.perf_counter() - t0) / 1e9
                got = kv_checksum(arena.region_bytes(Region(0, nbytes, nbytes)))
                if got != kv_checksum(staging):
                    raise PathUnavailable("proxy probe: bytes differ after the copy")
            finally:
                arena.close()
        except PathUnavailable:
            raise
        except Exception as exc:
            raise PathUnavailable(f"proxy probe failed: {type(exc).__name__}: {exc}") from exc
        self.probe_gbps = gbps
        if gbps < self.min_gbps:
            raise PathUnavailable(f"proxy probe: {gbps:.1f} GB/s, expected >= {self.min_gbps:.0f} GB/s")

    def close(self) -> None:
        """Drop the staging registrations (the proxy unmaps them) and free idle slabs."""
        with self._lock:
            owner, self._owner = self._owner, None
            free, self._free = self._free, []
            clients, self._clients = self._clients, []
        for c in clients:  # the proxy lets go of P's lock as each closes
            c.close()
        if owner is not None:
            owner.close()
        if free:
            k = kernels()
            for s in free:
                k.free(self.device, s.ptr)


__all__ = ["ProxyPath", "ProxyPeer"]
