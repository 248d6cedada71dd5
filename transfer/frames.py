"""Control frames: 4-byte big-endian length + UTF-8 JSON object with an integer "type" (MsgType).

HELLO carries file descriptors (SCM_RIGHTS) alongside its bytes. Anything malformed (oversized, not
JSON, not an object, unknown type, missing or mistyped field) raises `ProtocolError`, and the reader's
owner closes that connection; other connections are unaffected.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import socket
import struct
import time
from enum import IntEnum
from typing import Any

import numpy as np

from .errors import ProtocolError

PROTOCOL_VERSION = 3  # 2: PULL_ROWS (P writes D's pool pages directly); 3: DROP
MAX_FRAME_BYTES = 1 << 20  # a PULL_ROWS of a long prompt in a fragmented pool lists many slot runs
MAX_FDS = 4
_HEADER = struct.Struct(">I")


class MsgType(IntEnum):
    HELLO = 1  # D -> P: {v, layout, layout_fp, path, arena, d_instance} + arena fds
    HELLO_ACK = 2  # P -> D: {v, instance}
    PULL = 3  # D -> P: {tid, offset, nbytes, remaining_ms}: copy into D's receive region at offset
    DONE = 4  # P -> D: {tid, nbytes, checksum, copy_start_ns, copy_end_ns}
    FAILED = 5  # P -> D: {tid (None for HELLO), reason, detail}
    ABORT = 6  # D -> P: {tid}
    ABORT_ACK = 7  # P -> D: {tid}
    PING = 8  # D -> P: {nonce}
    PONG = 9  # P -> D: {nonce, instance}
    PULL_ROWS = 10  # D -> P: {tid, dst, nbytes, remaining_ms}; dst = D's slots as [start, count, ...] runs
    DROP = 11  # D -> P: {tid, instance}: D shed the handoff and will never pull tid; no reply


class FailReason(IntEnum):
    """Why P refused a HELLO or a PULL. Every FAILED for a PULL means no write for it can still land."""

    UNKNOWN = 1  # no such offer (never offered, already pulled or finished)
    EXPIRED = 2  # offer TTL or PULL deadline passed before the copy started
    ABORTED = 3  # tombstoned by an ABORT before the copy started
    LAYOUT_MISMATCH = 4
    BAD_REGION = 5  # offset/nbytes outside the arena or not the offer's size
    COPY_ERROR = 6  # gather or copy raised; the copy call has returned
    PATH_MISMATCH = 7
    CLOSING = 8  # P is shutting down or fatal
    BAD_VERSION = 9
    NO_DIRECT = 10  # PULL_ROWS but this P cannot write D's pool directly (no source rows, or the path)


_FIELDS: dict[MsgType, dict[str, tuple[type, ...]]] = {
    MsgType.HELLO: {
        "v": (int,),
        "layout": (dict,),
        "layout_fp": (str,),
        "path": (str,),
        "arena": (dict,),
        "d_instance": (str,),
    },
    MsgType.HELLO_ACK: {"v": (int,), "instance": (str,)},
    MsgType.PULL: {"tid": (str,), "offset": (int,), "nbytes": (int,), "remaining_ms": (int, float)},
    MsgType.DONE: {
        "tid": (str,),
        "nbytes": (int,),
        "checksum": (str,),
        "copy_start_ns": (int,),
        "copy_end_ns": (int,),
    },
    MsgType.FAILED: {"tid": (str, type(None)), "reason": (int,), "detail": (str,)},
    MsgType.ABORT: {"tid": (str,)},
    MsgType.ABORT_ACK: {"tid": (str,)},
    MsgType.PING: {"nonce": (int,)},
    MsgType.PONG: {"nonce": (int,), "instance": (str,)},
    MsgType.PULL_ROWS: {"tid": (str,), "dst": (list,), "nbytes": (int,), "remaining_ms": (int, float)},
    MsgType.DROP: {"tid": (str,), "instance": (str,)},
}


def encode(kind: MsgType, **fields: Any) -> bytes:
    """One frame's bytes. Called by both sides for every message they send."""
    body = json.dumps({"type": int(kind), **fields}, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return _HEADER.pack(len(body)) + body


def decode(body: bytes) -> tuple[MsgType, dict[str, Any]]:
    """Parse and validate one frame body (without its length prefix)."""
    try:
        msg = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame is not a JSON object")
    raw_type = msg.get("type")
    if type(raw_type) is not int or raw_type not in MsgType._value2member_map_:
        raise ProtocolError(f"unknown frame type {raw_type!r}")
    kind = MsgType(raw_type)
    for name, types in _FIELDS[kind].items():
        value = msg.get(name, ...)
        if value is ... or isinstance(value, bool) or not isinstance(value, types):
            raise ProtocolError(f"{kind.name} field {name!r} missing or mistyped: {value!r}")
    return kind, msg


def send_frame(sock: socket.socket, frame: bytes, fds: tuple[int, ...] = (), timeout_s: float = 2.0) -> None:
    """Write one whole frame (and `fds`, if any, with its first byte) or raise `OSError`.

    Never blocks longer than `timeout_s` even if the peer is stopped and its buffer is full: a frame
    that cannot be written in time leaves the stream torn, so the caller must close the socket.
    Callers serialise sends on one socket with their own lock.
    """
    deadline = time.monotonic() + timeout_s
    view = memoryview(frame)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    while view:
        try:
            sent = sock.sendmsg([view], anc, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            sent = 0
        if sent:
            view = view[sent:]
            anc = []
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("control socket send timed out (peer stopped or not reading)")
        select.select([], [sock], [], left)


class FrameReader:
    """Reads frames (and any passed fds) from one blocking socket; owned by that socket's reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()
        self._fds: list[int] = []

    def read(self) -> tuple[MsgType, dict[str, Any], list[int]]:
        """Block for the next frame. Raises `EOFError` on orderly close, `ProtocolError` if malformed.

        Returned fds belong to the caller (close them if unused); fds that arrived with a frame other
        than HELLO are closed here.
        """
        while True:
            if len(self._buf) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(self._buf)
                if length == 0 or length > MAX_FRAME_BYTES:
                    self.close_fds()
                    raise ProtocolError(f"bad frame length {length}")
                if len(self._buf) >= _HEADER.size + length:
                    body = bytes(self._buf[_HEADER.size : _HEADER.size + length])
                    del self._buf[: _HEADER.size + length]
                    fds, self._fds = self._fds, []
                    try:
                        kind, msg = decode(body)
                    except ProtocolError:
                        _close_all(fds)
                        raise
                    if kind is not MsgType.HELLO:
                        _close_all(fds)
                        fds = []
                    return kind, msg, fds
            self._recv()

    def _recv(self) -> None:
        data, ancdata, _flags, _addr = self._sock.recvmsg(
            65536, socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        )
        for level, ctype, cdata in ancdata:
            if level == socket.SOL_SOCKET and ctype == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self._fds.extend(fds)
        if not data:
            self.close_fds()
            raise EOFError("peer closed the control connection")
        self._buf.extend(data)

    def close_fds(self) -> None:
        _close_all(self._fds)
        self._fds = []


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def expand_runs(runs: list[int]) -> np.ndarray:
    """[start, count, start, count, ...] -> the int64 slots they cover, in order."""
    starts = np.asarray(runs[::2], dtype=np.int64)
    counts = np.asarray(runs[1::2], dtype=np.int64)
    if starts.size == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.cumsum(counts) + counts, counts)
    return offsets + np.arange(int(counts.sum()), dtype=np.int64)


def compress_runs(slots: np.ndarray) -> list[int]:
    """The inverse of `expand_runs`: maximal runs of consecutive slots as a flat int list."""
    s = np.asarray(slots, dtype=np.int64).reshape(-1)
    if s.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(s) != 1) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [s.size])))
    out = np.empty(2 * starts.size, dtype=np.int64)
    out[0::2], out[1::2] = s[starts], counts
    return [int(x) for x in out]
