"""IPC proxy sidecar: copies P's staging into D's arena for processes that each see only their own GPU.

Why: in containers that expose one GPU each, P cannot open D's IPC handle (docs/transfer.md). The proxy is
one process per P/D unit (never one per machine: a shared daemon became a queue) that requests no GPU
but sees all of them. D registers its receive arena and P its staging buffers over the unit's socket
`control_dir(unit)/proxy.sock`, sending legacy IPC handles and the PCI bus id of the GPU that owns the
memory; the proxy opens both, enables peer access, and runs each copy in the destination's context on
a dedicated stream, replying only after the stream synchronised.

Wire: the control plane's framing (4-byte big-endian length + UTF-8 JSON), requests with an `op`:
`register {role: staging|pool|arena, handle, nbytes, bus_id, layout_fp}` -> `{ok, id}`; `unregister {id}`;
`copy {src, src_offset, dst, dst_offset, nbytes}` -> `{ok, ns}`; `write_rows {src, src_slots, src_rows,
dst, dst_slots, dst_rows, num_lt, row_bytes}` -> `{ok, ns}` (direct mode: the fused row kernel reads P's
registered pool — or staging — at `src_slots` and writes D's registered pool at `dst_slots`; slots are
base64 of little-endian int32, so a fragmented request costs no JSON list of thousands of ints);
`ping` -> `{ok, pid, devices}`; `hold_lock {}` with one fd (SCM_RIGHTS) -> `{ok}`.
Errors come back as `{ok: false, error}` and close nothing else. A registration lives until its
connection closes or it is unregistered; unregistering waits for copies that use it.

Proof (docs/protocol.md): a connection's requests are served one at a time, and the proxy replies to
`copy` only after the copy finished, so when P's `copy_to_peer` returns (reply, or the proxy's socket
closed: the proxy finished the copy or died with its context) no byte can still land.

P's death is D's other proof (its slot's instance lock is free), but a proxy copy started for P
finishes after P is gone. So every connection P copies on first sends `hold_lock` with P's instance
lock fd; the proxy keeps that descriptor (the same open file description, so the same flock) until
the connection's thread has finished its last request and seen the connection close. P's lock is
therefore free only when P is dead *and* no copy the proxy runs for it can still land.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._conn import accepted
from ..control import DEFAULT_UNIT, connect_unix, control_dir, listen_unix, lock_held, peer_cred, same_user
from ..errors import ProtocolError, TransferError
from ..frames import MAX_FRAME_BYTES, send_frame

log = logging.getLogger(__name__)
_HEADER = struct.Struct(">I")


def proxy_socket_path(unit: str, name: str = "proxy") -> str:
    """The unit's proxy endpoint (inside the 0700 control directory both P and D resolve)."""
    return str(control_dir(unit) / f"{name}.sock")


def send_msg(sock: socket.socket, obj: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"proxy frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    send_frame(sock, _HEADER.pack(len(body)) + body, fds, timeout_s=10.0)


def lock_is_held(fd: int) -> bool:
    """Does some process hold an exclusive flock on the file `fd` refers to? Probed by path through
    /proc (a new open file description: a flock on `fd` itself would convert the holder's lock);
    OSError if that file cannot be reopened (a socket, a pipe)."""
    return lock_held(f"/proc/self/fd/{fd}", os.O_NONBLOCK)


def _recv_exact(sock: socket.socket, n: int, fds: list[int] | None) -> bytes:
    """`n` bytes; descriptors that arrive with them are appended to `fds` (closed if `fds` is None)."""
    buf = bytearray()
    while len(buf) < n:
        chunk, got, _, _ = socket.recv_fds(sock, n - len(buf), 4)
        if fds is None:
            for fd in got:
                os.close(fd)
        else:
            fds.extend(got)
        if not chunk:
            raise EOFError("proxy connection closed")
        buf.extend(chunk)
    return bytes(buf)


def recv_msg(sock: socket.socket, fds: list[int] | None = None) -> dict[str, Any]:
    """One request or reply. Descriptors sent with it go to `fds` (the caller closes them)."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
    if length == 0 or length > MAX_FRAME_BYTES:
        raise ProtocolError(f"bad proxy frame length {length}")
    try:
        msg = json.loads(_recv_exact(sock, length, fds).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"proxy frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("proxy frame is not a JSON object")
    return msg


@dataclass(eq=False)
class _Entry:
    """A registration: the handle, the GPU that owns the memory, and its mappings per issuing context."""

    id: str
    role: str
    handle: bytes
    nbytes: int
    device: int
    owner: socket.socket
    maps: dict[int, int] = field(default_factory=dict)  # context device -> pointer in this process
    busy: int = 0
    closed: bool = False


class ProxyServer:
    """The sidecar. `start()` serves on a thread; `close()` stops it and closes every mapping."""

    def __init__(self, unit: str, name: str = "proxy", issue: str = "dst") -> None:
        """`issue`: whose context runs the copy — "dst" (default: D's GPU pulls P's staging) or "src"
        (P's GPU pushes into D's arena). Both handles are opened in that context: a pointer opened in
        the owning GPU's context and copied from another ran at ~36 GB/s (staged), not NVLink speed."""
        if issue not in ("dst", "src"):
            raise ValueError(f"issue must be dst or src, got {issue!r}")
        self.issue = issue
        self._kernels: Any = None
        self.path = proxy_socket_path(unit, name)
        self._lock = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._streams: dict[int, int] = {}
        self._scratch: dict[tuple[int, int], tuple[int, int]] = {}  # (connection, device) -> (ptr, bytes)
        self._layout_fp: str | None = None
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.copies = 0
        self.locks_held = 0

    @property
    def _k(self) -> Any:
        """The CUDA module, loaded on first use: `--help` and lock holding work without CUDA."""
        if self._kernels is None:
            from ._gpu import kernels

            self._kernels = kernels()
        return self._kernels

    def start(self) -> None:
        from pathlib import Path

        self._server = listen_unix(Path(self.path))
        self._server.settimeout(0.1)
        t = threading.Thread(target=self._accept_loop, name="tandem-proxy-accept", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5.0)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        with self._lock:
            entries = list(self._entries.values())
        for e in entries:
            self._unregister(e.id)

    def _accept_loop(self) -> None:
        assert self._server is not None
        for sock in accepted(self._server, self._stop):
            if not same_user(sock):
                sock.close()
                continue
            t = threading.Thread(target=self._serve, args=(sock,), name="tandem-proxy-conn", daemon=True)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        held: list[int] = []  # P's instance-lock descriptors, closed only when this connection ends
        pid = peer_cred(sock)[0]
        try:
            while not self._stop.is_set():
                fds: list[int] = []
                try:
                    msg = recv_msg(sock, fds)
                    if msg.get("op") == "hold_lock":
                        reply = self._hold_lock(fds, held)
                    elif fds:
                        raise ValueError(f"{msg.get('op')!r} takes no file descriptors")
                    else:
                        reply = self._handle(sock, msg)
                except (TransferError, RuntimeError, KeyError, TypeError, ValueError) as exc:
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                finally:
                    for fd in fds:
                        os.close(fd)
                send_msg(sock, reply)
        except (EOFError, OSError, ProtocolError):
            pass
        finally:
            with self._lock:
                owned = [e.id for e in self._entries.values() if e.owner is sock]
            for eid in owned:
                self._unregister(eid)
            self._drop_scratch(sock)
            sock.close()
            # Last: this thread ran every copy of the connection to completion above, so nothing the
            # proxy does for that P can still land once its lock may be seen free.
            for fd in held:
                os.close(fd)
            if held:
                log.info("released the instance lock of pid %d (connection closed, no copy running)", pid)

    def _hold_lock(self, fds: list[int], held: list[int]) -> dict[str, Any]:
        """Keep P's instance-lock descriptor for the life of this connection (see module docstring)."""
        if len(fds) != 1:
            raise ValueError(f"hold_lock takes exactly one file descriptor, got {len(fds)}")
        fd = fds.pop()
        try:
            held_by_p = lock_is_held(fd)
        except OSError as exc:  # not a reopenable file (a socket, a pipe...)
            os.close(fd)
            raise ValueError(f"hold_lock: that descriptor is not an instance lock file ({exc})") from None
        if not held_by_p:
            os.close(fd)
            raise ValueError("hold_lock: that descriptor is not a held instance lock")
        held.append(fd)
        self.locks_held += 1
        return {"ok": True}

    def _handle(self, sock: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "devices": self._k.device_count()}
        if op == "register":
            return {"ok": True, "id": self._register(sock, msg)}
        if op == "unregister":
            self._unregister(str(msg["id"]))
            return {"ok": True}
        if op == "copy":
            return {"ok": True, "ns": self._copy(msg)}
        if op == "write_rows":
            return {"ok": True, "ns": self._write_rows(sock, msg)}
        raise ValueError(f"unknown op {op!r}")

    def _register(self, sock: socket.socket, msg: dict[str, Any]) -> str:
        role, nbytes, layout_fp = str(msg["role"]), int(msg["nbytes"]), msg.get("layout_fp")
        if role not in ("staging", "pool", "arena"):
            raise ValueError(f"role must be staging, pool or arena, got {role!r}")
        handle = bytes.fromhex(str(msg["handle"]))
        with self._lock:
            if layout_fp is not None:
                if self._layout_fp is None:
                    self._layout_fp = str(layout_fp)
                elif layout_fp != self._layout_fp:
                    raise TransferError(
                        f"layout mismatch: this unit's proxy serves layout {self._layout_fp}, "
                        f"the {role} registration has {layout_fp}"
                    )
        dev = self._k.device_by_pci_bus_id(str(msg["bus_id"]))
        for other in range(self._k.device_count()):
            if other != dev and self._k.can_access_peer(dev, other):
                self._k.enable_peer_access(dev, other)
                self._k.enable_peer_access(other, dev)
        if len(handle) != 64:
            raise ValueError(f"IPC handle must be 64 bytes, got {len(handle)}")
        entry = _Entry(secrets.token_hex(8), role, handle, nbytes, dev, sock)
        with self._lock:
            self._entries[entry.id] = entry
        return entry.id

    def _unregister(self, eid: str) -> None:
        with self._lock:
            entry = self._entries.get(eid)
            if entry is None or entry.closed:
                return
            entry.closed = True
            while entry.busy:
                self._lock.wait()
            del self._entries[eid]
        for ctx_dev, ptr in entry.maps.items():
            with contextlib.suppress(RuntimeError):
                self._k.ipc_close_handle(ctx_dev, ptr)

    def _mapped(self, entry: _Entry, ctx_dev: int) -> int:
        """The entry's pointer in `ctx_dev`'s context, opened on first use (caller holds the lock)."""
        ptr = entry.maps.get(ctx_dev)
        if ptr is None:
            try:
                ptr = entry.maps[ctx_dev] = self._k.ipc_open_handle(ctx_dev, entry.handle)
            except RuntimeError as exc:
                raise TransferError(
                    f"cannot open the {entry.role} IPC handle {entry.id} on device {ctx_dev}: {exc} "
                    "(its process exited or restarted?)"
                ) from exc
        return ptr

    def _copy(self, msg: dict[str, Any]) -> int:
        nbytes, s_off, d_off = int(msg["nbytes"]), int(msg["src_offset"]), int(msg["dst_offset"])
        with self._lock:
            src, dst = self._entries.get(str(msg["src"])), self._entries.get(str(msg["dst"]))
            if src is None or src.closed or src.role != "staging":
                raise TransferError(f"unknown staging registration {msg['src']!r}")
            if dst is None or dst.closed or dst.role != "arena":
                raise TransferError(f"unknown arena registration {msg['dst']!r} (D gone or restarted?)")
            if (
                nbytes <= 0
                or s_off < 0
                or d_off < 0
                or s_off + nbytes > src.nbytes
                or d_off + nbytes > dst.nbytes
            ):
                raise TransferError(f"copy of {nbytes} bytes outside the registered ranges")
            ctx, stream, src_ptr, dst_ptr = self._claim(src, dst)
        return self._issue(
            src,
            dst,
            stream,
            lambda: self._k.memcpy_async(ctx, dst_ptr + d_off, src_ptr + s_off, nbytes, stream),
        )

    def _claim(self, src: _Entry, dst: _Entry) -> tuple[int, int, int, int]:
        """Caller holds the lock: the issuing context and its stream, both entries mapped there and
        marked busy (a deregistration waits until `_issue` releases them)."""
        ctx = dst.device if self.issue == "dst" else src.device
        if ctx not in self._streams:
            self._streams[ctx] = self._k.stream_create(ctx)
        src_ptr, dst_ptr = self._mapped(src, ctx), self._mapped(dst, ctx)
        src.busy += 1
        dst.busy += 1
        return ctx, self._streams[ctx], src_ptr, dst_ptr

    def _issue(self, src: _Entry, dst: _Entry, stream: int, launch: Callable[[], None]) -> int:
        """Run `launch` on `stream` and wait for it (the reply is the proof that nothing of it can still
        land), then release the claimed entries; returns the nanoseconds it took."""
        try:
            t0 = time.perf_counter_ns()
            try:
                launch()
            finally:
                self._k.stream_synchronize(stream)
            self.copies += 1
            return time.perf_counter_ns() - t0
        finally:
            with self._lock:
                src.busy -= 1
                dst.busy -= 1
                self._lock.notify_all()

    def _write_rows(self, sock: socket.socket, msg: dict[str, Any]) -> int:
        """Direct mode: one fused row kernel from P's registered rows into D's registered pool, in the
        issuing context, synchronised before the reply (the same proof as `copy`)."""
        num_lt, row_bytes = int(msg["num_lt"]), int(msg["row_bytes"])
        src_rows, dst_rows = int(msg["src_rows"]), int(msg["dst_rows"])
        src_slots, dst_slots = (
            _slots(msg["src_slots"], src_rows, "src"),
            _slots(msg["dst_slots"], dst_rows, "dst"),
        )
        n = src_slots.size
        if n != dst_slots.size or n == 0:
            raise TransferError(f"{n} source rows but {dst_slots.size} destination rows")
        if num_lt <= 0 or row_bytes <= 0:
            raise TransferError(f"bad row geometry num_lt={num_lt} row_bytes={row_bytes}")
        with self._lock:
            src, dst = self._entries.get(str(msg["src"])), self._entries.get(str(msg["dst"]))
            if src is None or src.closed or src.role not in ("pool", "staging"):
                raise TransferError(f"unknown pool/staging registration {msg['src']!r}")
            if dst is None or dst.closed or dst.role != "arena":
                raise TransferError(f"unknown arena registration {msg['dst']!r} (D gone or restarted?)")
            if num_lt * src_rows * row_bytes > src.nbytes or num_lt * dst_rows * row_bytes > dst.nbytes:
                raise TransferError("row geometry outside the registered ranges")
            ctx, stream, src_ptr, dst_ptr = self._claim(src, dst)
            try:
                scratch = self._scratch_for(sock, ctx, 16 * n)
            except BaseException:
                src.busy -= 1
                dst.busy -= 1
                raise
        table = np.concatenate([src_slots, dst_slots])

        def launch() -> None:
            # On the kernel's stream: a plain cudaMemcpy's DMA runs on the legacy stream, which a
            # non-blocking stream is not ordered after (the kernel could read the last request's
            # slots). From pageable memory the call returns once `table` was staged.
            self._k.memcpy_async(ctx, scratch, table.ctypes.data, table.nbytes, stream)
            self._k.gather_write(
                src_ptr,
                src_rows,
                scratch,
                dst_ptr,
                dst_rows,
                scratch + 8 * n,
                num_lt,
                n,
                row_bytes,
                ctx,
                stream,
            )

        return self._issue(src, dst, stream, launch)

    def _scratch_for(self, sock: socket.socket, ctx: int, nbytes: int) -> int:
        """This connection's device buffer for slot tables on `ctx` (grown as needed; its requests run
        one at a time, so it is never shared). Freed when the connection ends. Caller holds the lock."""
        key = (id(sock), ctx)
        have = self._scratch.get(key)
        if have is not None and have[1] >= nbytes:
            return have[0]
        if have is not None:
            self._k.free(ctx, have[0])
        size = max(nbytes, 1 << 16)
        ptr = self._k.malloc(ctx, size)
        self._scratch[key] = (ptr, size)
        return int(ptr)

    def _drop_scratch(self, sock: socket.socket) -> None:
        with self._lock:
            mine = [k for k in self._scratch if k[0] == id(sock)]
            bufs = [(k[1], self._scratch.pop(k)[0]) for k in mine]
        for ctx, ptr in bufs:
            with contextlib.suppress(RuntimeError):
                self._k.free(ctx, ptr)


def encode_slots(slots: np.ndarray) -> str:
    """A write_rows request's slot list: base64 of little-endian int32 (see `_slots`)."""
    return base64.b64encode(np.ascontiguousarray(slots, dtype="<i4").tobytes()).decode()


def _slots(text: object, rows: int, what: str) -> np.ndarray:
    """A write_rows request's `encode_slots` text as int64 slots, each inside [0, rows)."""
    try:
        raw = base64.b64decode(text, validate=True) if isinstance(text, str) else b"?"
    except (binascii.Error, ValueError):
        raw = b"?"
    if len(raw) % 4:
        raise TransferError(f"{what}_slots must be base64 of little-endian int32")
    slots = np.frombuffer(raw, dtype="<i4").astype(np.int64)
    if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= rows):
        raise TransferError(f"{what}_slots reach outside the {rows} registered rows")
    return slots


class ProxyClient:
    """One connection to the unit's proxy; requests are serialised on it (one reply per request)."""

    def __init__(self, path: str, timeout_s: float = 2.0) -> None:
        self.path = path
        try:
            self.sock = connect_unix(path, timeout_s)
        except OSError as exc:
            raise TransferError(
                f"no IPC proxy at {path} ({exc}); start `tandem-proxy --unit <unit>`"
            ) from exc
        self._lock = threading.Lock()
        self.closed = False

    def request(self, fds: tuple[int, ...] = (), **msg: Any) -> dict[str, Any]:
        """Send one request (with `fds`, if any) and block for its reply (no timeout: a copy's reply is
        its proof)."""
        with self._lock:
            try:
                send_msg(self.sock, msg, fds)
                reply = recv_msg(self.sock)
            except (EOFError, OSError, ProtocolError) as exc:
                self.close()  # a torn frame leaves the stream unusable; the next request reconnects
                raise TransferError(f"IPC proxy connection failed: {exc}") from exc
        if not reply.get("ok"):
            raise TransferError(f"IPC proxy refused {msg.get('op')}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        """Shut down, then close: a forked child that inherited the socket must not keep the proxy
        from seeing EOF (which is when it lets go of P's lock)."""
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def main(argv: list[str] | None = None) -> None:
    """`tandem-proxy --unit U`: serve the unit's proxy socket until SIGTERM/SIGINT."""
    ap = argparse.ArgumentParser(description="tandem IPC proxy sidecar (one per P/D unit)")
    ap.add_argument("--unit", default=os.environ.get("TANDEM_UNIT", DEFAULT_UNIT))
    ap.add_argument("--name", default="proxy", help="socket name inside the unit's control directory")
    ap.add_argument("--issue", default="dst", choices=["dst", "src"], help="whose GPU context runs copies")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tandem-proxy %(levelname)s %(message)s")
    server = ProxyServer(args.unit, args.name, args.issue)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("serving %s (pid %d)", server.path, os.getpid())
    print(f"tandem-proxy ready {server.path}", flush=True)
    stop.wait()
    server.close()
    log.info("stopped after %d copies", server.copies)


if __name__ == "__main__":
    main()
