"""Device-memory plumbing shared by the GPU paths (`cuda`, `proxy`): no protocol here.

* `kernels()` — the compiled `tandem.csrc._cuda_kernels` module, or `PathUnavailable` saying why not.
* `DeviceBuffer` — owns raw device memory (cudaMalloc, a VMM mapping, an IPC mapping) and frees it when
  the last torch view of it dies, so an engine still holding `handle.tensor()` never reads freed memory.
* `CopyStream` — the one dedicated stream per device on which a path's crossing copy runs; `copy`
  returns only when the copy has completed (the "no byte can still land" rule of `copy_to_peer`).
* `probe_transfer` — a real cross-process transfer plus a bandwidth self-test, with the D half run by
  `tandem.csrc.probe_child` (a legacy IPC handle cannot be opened by the process that exported it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..errors import PathUnavailable, TransferError

_PROBE_TIMEOUT_S = 120.0


def kernels() -> ModuleType:
    """The compiled module; raises `PathUnavailable` if it is not built or CUDA is absent."""
    from tandem.csrc import kv_cuda

    mod = kv_cuda.module()
    if mod is None:
        raise PathUnavailable(kv_cuda.build_info())
    if not torch.cuda.is_available():
        raise PathUnavailable("CUDA not available (torch.cuda.is_available() is False)")
    return mod


def current_device() -> int:
    """The device this process's engine uses: torch's current CUDA device."""
    if not torch.cuda.is_available():
        raise PathUnavailable("CUDA not available (torch.cuda.is_available() is False)")
    return torch.cuda.current_device()


class DeviceBuffer:
    """Raw device memory exposed to torch through `__cuda_array_interface__`.

    `release` runs once, when this object is garbage: torch views made by `tensor()` hold a reference,
    so the memory outlives `close()` of its owner for as long as any view is alive.
    """

    def __init__(self, ptr: int, nbytes: int, device: int, release: Callable[[], None]) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.device = device
        self._release: Callable[[], None] | None = release

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }

    def tensor(self) -> torch.Tensor:
        """uint8 view of all of it on `cuda:<device>` (no copy)."""
        with torch.cuda.device(self.device):
            return torch.as_tensor(self, device=torch.device("cuda", self.device))

    def __del__(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown: the context may be gone already
                release()


class CopyStream:
    """One non-blocking stream per device for crossing copies, created on first use; thread-safe."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, device: int) -> torch.cuda.Stream:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = torch.cuda.Stream(device=device)
            return s

    def run(self, device: int, launch: Callable[[], None]) -> None:
        """Run `launch` (kernels queued on the current stream) on this device's dedicated stream, after
        everything already queued on the caller's current stream, and return once it completed. A
        failure raises after the same proof (the stream was drained)."""
        stream = self.get(device)
        dev = torch.device("cuda", device)
        stream.wait_stream(torch.cuda.current_stream(dev))
        try:
            with torch.cuda.stream(stream):
                launch()
        finally:
            stream.synchronize()

    def copy(self, dst_ptr: int, staging: torch.Tensor) -> None:
        """Copy all of `staging` to `dst_ptr` and return once it completed (dst written).

        Ordered after everything already queued on the caller's current stream (the gather), run on
        the dedicated stream so it never waits behind unrelated work, then synchronised: when this
        returns no byte of it can still land. A failure raises `TransferError` after the same proof.
        """
        k = kernels()
        dev = staging.device.index
        assert dev is not None
        stream = self.get(dev)
        stream.wait_stream(torch.cuda.current_stream(staging.device))
        nbytes = staging.numel() * staging.element_size()
        try:
            k.memcpy_async(dev, dst_ptr, staging.data_ptr(), nbytes, stream.cuda_stream)
        finally:
            k.stream_synchronize(stream.cuda_stream)  # also when enqueueing failed: drain what is queued


def check_staging(staging: torch.Tensor, device: int) -> int:
    """Bytes of a staging tensor a GPU path can copy; raises `TransferError` on anything else."""
    if not staging.is_cuda or staging.device.index != device:
        raise TransferError(f"staging must be on cuda:{device}, got {staging.device}")
    if not staging.is_contiguous():
        raise TransferError("staging must be contiguous")
    return staging.numel() * staging.element_size()


def check_range(offset: int, nbytes: int, capacity: int) -> None:
    if offset < 0 or nbytes < 0 or offset + nbytes > capacity:
        raise TransferError(f"copy of {nbytes} bytes at offset {offset} outside the {capacity}-byte arena")


def peer_device(device: int) -> int:
    """The device a probe's D half uses: another visible GPU if there is one (the real case), else ours."""
    n = torch.cuda.device_count()
    return (device + 1) % n if n > 1 else device


def _read_json(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise PathUnavailable(f"probe child gave no answer in {timeout_s:.0f}s (exit code {proc.poll()})")
    msg: dict[str, Any] = json.loads(line)
    if "error" in msg:
        raise PathUnavailable(f"probe child failed: {msg['error']}")
    return msg


def probe_transfer(
    name: str,
    child_kind: str,
    device: int,
    open_peer: Callable[[dict[str, Any], list[int]], Any],
    copy: Callable[[torch.Tensor, Any, int], None],
    close_peer: Callable[[Any], None],
    min_gbps: float,
    nbytes: int = 64 << 20,
    repeats: int = 10,
) -> float:
    """Run the D half in a child on `peer_device(device)`, open its export with `open_peer`, copy
    random bytes in with `copy` (`repeats` times, timed), and have the child verify them. Returns GB/s.
    Raises `PathUnavailable` naming the failure, including a bandwidth under `min_gbps`."""
    kernels()
    peer_dev = peer_device(device)
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    cmd = [sys.executable, "-m", "tandem.csrc.probe_child", child_kind, str(peer_dev), str(nbytes)]
    cmd.append(str(child_sock.fileno()))
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(child_sock.fileno(),)
    )
    child_sock.close()
    peer = None
    try:
        meta = _read_json(proc, _PROBE_TIMEOUT_S)["meta"]
        fds: list[int] = []
        if meta.get("handle_type") == "posix_fd":
            _, fds, _, _ = socket.recv_fds(parent_sock, 1, 1)
        peer = open_peer(meta, fds)
        staging = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=torch.device("cuda", device))
        digest = hashlib.sha256(staging.cpu().numpy().tobytes()).hexdigest()
        copy(staging, peer, 0)  # warm-up (peer access, first-touch mappings)
        t0 = time.perf_counter()
        for _ in range(repeats):
            copy(staging, peer, 0)
        gbps = nbytes * repeats / (time.perf_counter() - t0) / 1e9
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"sha256": digest, "nbytes": nbytes}) + "\n")
        proc.stdin.flush()
        if not _read_json(proc, _PROBE_TIMEOUT_S)["ok"]:
            raise PathUnavailable(f"{name} probe: the bytes D received differ from P's staging")
    except PathUnavailable:
        raise
    except Exception as exc:
        raise PathUnavailable(f"{name} probe failed: {type(exc).__name__}: {exc}") from exc
    finally:
        if peer is not None:
            close_peer(peer)
        parent_sock.close()
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if gbps < min_gbps:
        raise PathUnavailable(
            f"{name} probe: {gbps:.1f} GB/s cuda:{device} -> cuda:{peer_dev}, expected >= "
            f"{min_gbps:.0f} GB/s (no NVLink/peer access? refusing rather than running slow silently)"
        )
    return gbps


__all__ = [
    "CopyStream",
    "DeviceBuffer",
    "check_range",
    "check_staging",
    "current_device",
    "kernels",
    "peer_device",
    "probe_transfer",
]
