"""The TCP path: the degraded / cross-host fallback ("TKV3" on the wire: every chunk carries its transfer
id, D's arena epoch and its offset, so D drops any chunk of a transfer it no longer expects).

P streams a transfer's staging bytes as chunks over TCP to D's data listener (127.0.0.1 by default;
`bind_host`, for a cross-host unit). It is ~300x slower than a same-machine
path and is never chosen silently: only when named in `transfer.paths` (and `select_path` logs any
path it skipped to get here).

Wire (one TCP connection per copy, big-endian):
    D -> P  b"TKV3" + nonce_d[32]
    P -> D  HMAC(secret, b"p" + nonce_d + nonce_p)[32] + nonce_p[32]
    D -> P  HMAC(secret, b"d" + nonce_p + nonce_d)[32]          (mutual: P never streams KV to an impostor)
    P -> D  chunk: kind u8 (1=DATA, 2=END), tid[16], epoch[16], offset u64, length u32, then `length` bytes
    D -> P  after END: tid[16], status u8 (1=COMPLETE, 2=DROPPED), received u64
The secret is 32 random bytes in `<control_dir(unit)>/tcp.secret` (0600 inside the unit's 0700 dir),
created by D; D names the file in HELLO's arena metadata (HELLO travels over the unit's unix socket,
peer uid checked), P reads it. Anyone without it — another local user, another host reaching the
port — cannot finish the handshake, so cannot write D's memory nor receive P's KV.

Every chunk names its transfer id, D's arena epoch (random per arena, so a restarted D drops chunks
meant for its previous incarnation even on a reused port) and its absolute offset. D copies a chunk
into its own memory only while it still expects that transfer at that range, and the check and the
copy happen under one lock. Hence this path's own proof: once the receiver has called
`forget(region)` (it stopped expecting the transfer), no byte of it can land — a late chunk is
counted and dropped. D may free a failed transfer's region at once, without waiting for P's
ABORT_ACK, DONE, FAILED, instance change or lock (`receiver_writes = True`). END gets D's
confirmation of the transfer's terminal state: COMPLETE (all `nbytes` written) or DROPPED, which
`copy_to_peer` turns into an exception (P then reports FAILED COPY_ERROR, itself a proof).

Wiring: the sender passes the transfer id to `copy_to_peer` (a copy without one is refused); the
receiver calls `arena.expect(region, tid)` just before it sends the PULL and `arena.forget(region)`
before any region goes back to the allocator, and on a failure frees the region at once with
`ReleaseReason.RECEIVER_DROPS` (docs/protocol.md, "The TCP path").
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .._conn import accepted
from ..arena import Region
from ..auth import (
    SECRET_NAME,
    AuthFailed,
    accept_handshake,
    connect_handshake,
    read_secret,
    recv_exact,
    unit_secret,
)
from ..checksum import kv_checksum
from ..control import control_dir
from ..errors import PathUnavailable, TransferError
from ..layout import WireLayout
from .base import ArenaExport, LocalArena, PeerArena, TransferPath

MAGIC = b"TKV3"
DATA, END = 1, 2
COMPLETE, DROPPED = 1, 2
CHUNK_HEADER = struct.Struct(">B16s16sQI")
REPLY = struct.Struct(">16sBQ")
ROLES = (b"d", b"p")  # (listener = D, connector = P) MAC roles of the data handshake
DEFAULT_CHUNK = 1 << 20
MAX_CHUNK = 16 << 20


@dataclass(frozen=True)
class TcpStats:
    chunks_written: int
    chunks_dropped: int
    auth_failures: int
    expected: int


class TcpArena(LocalArena):
    """D's receive memory (plain host memory) plus the data listener that writes into it.

    `expect(region, tid)` / `forget(region)` are the receiver's hooks (see module docstring); the
    listener's threads are the only writers, and only for expected (tid, epoch, range)."""

    def __init__(
        self, nbytes: int, secret_path: Path, bind_host: str, advertise_host: str | None = None
    ) -> None:
        self.nbytes = nbytes
        self.epoch = secrets.token_bytes(16)
        self.secret_path = secret_path
        self._secret = read_secret(secret_path)
        self._bytes = torch.zeros(nbytes, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._expected: dict[bytes, tuple[Region, int]] = {}  # tid -> (region, bytes received)
        self._counts = {"written": 0, "dropped": 0, "auth": 0}
        self._conns: set[socket.socket] = set()
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        self._server = socket.create_server((bind_host, 0), family=family)
        self._server.settimeout(0.2)
        self.host, self.port = advertise_host or bind_host, self._server.getsockname()[1]
        self._stop = threading.Event()
        self._accept = threading.Thread(target=self._accept_loop, name="tandem-tcp-accept", daemon=True)
        self._accept.start()

    # ---- receiver hooks --------------------------------------------------------------------------

    def expect(self, region: Region, tid: str) -> None:
        """Called once per transfer before its PULL leaves D: chunks of `tid` may now fill `region`."""
        with self._lock:
            self._expected[bytes.fromhex(tid)] = (region, 0)

    def forget(self, region: Region) -> None:
        """Called before `region` is freed or reused. Returns only when no chunk is being written into
        it; every later chunk for it is dropped — the path's proof that no write can still land."""
        with self._lock:
            for tid, (r, _) in list(self._expected.items()):
                if r.offset == region.offset:
                    del self._expected[tid]

    def late_chunks_dropped(self) -> int:
        with self._lock:
            return self._counts["dropped"]

    def stats(self) -> TcpStats:
        with self._lock:
            c = self._counts
            return TcpStats(c["written"], c["dropped"], c["auth"], len(self._expected))

    # ---- LocalArena ------------------------------------------------------------------------------

    def export(self) -> ArenaExport:
        meta: dict[str, int | str] = {
            "kind": "tcp",
            "host": self.host,
            "port": self.port,
            "epoch": self.epoch.hex(),
            "nbytes": self.nbytes,
            "secret_path": str(self.secret_path),
        }
        return ArenaExport(meta=meta)

    def region_bytes(self, region: Region) -> torch.Tensor:
        return self._bytes[region.offset : region.offset + region.nbytes]

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._accept.join(2.0)

    # ---- listener --------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        for sock in accepted(self._server, self._stop):
            with self._lock:
                self._conns.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="tandem-tcp-data", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            try:
                accept_handshake(sock, self._secret, MAGIC, ROLES)
            except AuthFailed:
                with self._lock:
                    self._counts["auth"] += 1
                return
            while True:
                kind, tid, epoch, offset, length = CHUNK_HEADER.unpack(recv_exact(sock, CHUNK_HEADER.size))
                if kind == DATA:
                    if length > MAX_CHUNK:
                        return
                    payload = recv_exact(sock, length)
                    self._write(tid, epoch, offset, payload)
                elif kind == END:
                    sock.sendall(self._end(tid, epoch, offset))
                else:
                    return
        except (EOFError, OSError, struct.error):
            pass
        finally:
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _write(self, tid: bytes, epoch: bytes, offset: int, payload: bytes) -> None:
        n = len(payload)
        with self._lock:  # check and copy under one lock: `forget` cannot slip in between
            want = self._expected.get(tid)
            ok = (
                epoch == self.epoch
                and want is not None
                and want[0].offset <= offset
                and offset + n <= want[0].offset + want[0].nbytes
            )
            if not ok or want is None:
                self._counts["dropped"] += 1
                return
            self._bytes[offset : offset + n].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            self._expected[tid] = (want[0], want[1] + n)
            self._counts["written"] += 1

    def _end(self, tid: bytes, epoch: bytes, nbytes: int) -> bytes:
        with self._lock:
            want = self._expected.get(tid)
            done = epoch == self.epoch and want is not None and want[1] == nbytes == want[0].nbytes
            received = 0 if want is None else want[1]
        return REPLY.pack(tid, COMPLETE if done else DROPPED, received)


class TcpPeerArena(PeerArena):
    """P's handle on one D's data listener: where to connect, D's epoch and the unit secret."""

    def __init__(self, host: str, port: int, epoch: bytes, nbytes: int, secret: bytes) -> None:
        self.host, self.port, self.epoch, self.nbytes = host, port, epoch, nbytes
        self.secret = secret

    def close(self) -> None:
        pass


class TcpPath(TransferPath):
    """Chunks over TCP into D's memory; D drops what it no longer expects (see module docstring)."""

    name = "tcp"
    receiver_writes = True  # D itself writes every byte, so `forget` is proof (module docstring)

    def __init__(
        self,
        bind_host: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK,
        connect_timeout_s: float = 5.0,
        confirm_timeout_s: float = 30.0,
        advertise_host: str | None = None,
        secret_file: str | None = None,
    ) -> None:
        """`bind_host`: D's data listener address (default loopback);
        `advertise_host`: the address P is told to connect to (default `bind_host`; set it when binding
        a wildcard across hosts); `secret_file`: the unit secret both hosts mount (default: the unit's
        control directory, which only works on one host)."""
        self.bind_host = bind_host or "127.0.0.1"
        self.advertise_host = advertise_host
        self.secret_file = Path(secret_file) if secret_file else None
        if not 0 < chunk_bytes <= MAX_CHUNK:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK}]")
        self.chunk_bytes = chunk_bytes
        self.connect_timeout_s = connect_timeout_s
        self.confirm_timeout_s = confirm_timeout_s

    def probe(self) -> None:
        try:
            arena = self.create_arena(2 * 4096, "probe")
            try:
                peer = self.open_peer_arena(arena.export().meta, [])
                staging = torch.randn(self.alloc_staging(WireLayout(1, 1, 8, "float32"), 16).shape)
                region = Region(offset=4096, nbytes=staging.numel() * 4, alloc_bytes=4096)
                tid = secrets.token_hex(16)
                arena.expect(region, tid)
                self.copy_to_peer(staging, peer, region.offset, tid=tid)
                if kv_checksum(arena.region_bytes(region)) != kv_checksum(staging):
                    raise PathUnavailable("tcp probe: bytes differ after the copy")
            finally:
                arena.close()
        except PathUnavailable:
            raise
        except Exception as exc:
            raise PathUnavailable(f"tcp probe failed: {exc!r}") from exc

    def create_arena(self, nbytes: int, label: str) -> TcpArena:
        """`label` is the receiver's `<unit>-<instance>`: the secret lives in that unit's control dir."""
        if self.secret_file is not None:
            return TcpArena(nbytes, self.secret_file, self.bind_host, self.advertise_host)
        directory = control_dir(label.rsplit("-", 1)[0])
        unit_secret(directory)  # create it if this is the unit's first data path
        return TcpArena(nbytes, directory / SECRET_NAME, self.bind_host, self.advertise_host)

    def open_peer_arena(self, meta: Mapping[str, object], fds: list[int]) -> PeerArena:
        for fd in fds:
            os.close(fd)
        try:
            if meta.get("kind") != "tcp":
                raise ValueError(f"kind {meta.get('kind')!r}")
            epoch = bytes.fromhex(str(meta["epoch"]))
            host, port, nbytes = str(meta["host"]), int(str(meta["port"])), int(str(meta["nbytes"]))
            secret = read_secret(self.secret_file or Path(str(meta["secret_path"])))
        except (KeyError, ValueError, OSError, TransferError) as exc:
            raise TransferError(f"tcp path: bad arena metadata {dict(meta)}: {exc}") from None
        return TcpPeerArena(host, port, epoch, nbytes, secret)

    def alloc_staging(self, layout: WireLayout, n_tokens: int) -> torch.Tensor:
        return torch.empty(layout.staging_shape(n_tokens), dtype=layout.dtype)

    def copy_to_peer(self, staging: torch.Tensor, peer: PeerArena, offset: int, tid: str = "") -> None:
        """Stream `staging` to D at `offset` as transfer `tid`; returns when D confirmed COMPLETE.
        Raises `TransferError` on DROPPED, a failed handshake, or a lost connection."""
        assert isinstance(peer, TcpPeerArena)
        if not tid:
            raise TransferError("tcp path: copy_to_peer needs the transfer id (tid=); see paths/tcp.py")
        src = staging.contiguous().reshape(-1).view(torch.uint8).numpy()
        n = src.nbytes
        if offset < 0 or offset + n > peer.nbytes:
            raise TransferError(f"copy of {n} bytes at {offset} outside {peer.nbytes} bytes")
        tid_b = bytes.fromhex(tid)
        try:
            with socket.create_connection((peer.host, peer.port), timeout=self.connect_timeout_s) as sock:
                try:
                    connect_handshake(sock, peer.secret, MAGIC, ROLES, what="tandem data listener")
                except AuthFailed as exc:
                    raise TransferError(f"tcp path: {exc}") from None
                sock.settimeout(self.confirm_timeout_s)
                view = src.data
                for pos in range(0, n, self.chunk_bytes):
                    chunk = view[pos : pos + self.chunk_bytes]
                    sock.sendall(CHUNK_HEADER.pack(DATA, tid_b, peer.epoch, offset + pos, len(chunk)))
                    sock.sendall(chunk)
                sock.sendall(CHUNK_HEADER.pack(END, tid_b, peer.epoch, n, 0))
                _, status, received = REPLY.unpack(recv_exact(sock, REPLY.size))
        except (OSError, EOFError) as exc:
            raise TransferError(f"tcp path: data connection failed: {exc!r}") from exc
        if status != COMPLETE:
            raise TransferError(f"tcp path: D dropped transfer {tid} ({received} of {n} bytes written)")
