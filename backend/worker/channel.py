"""The channel between a model's Triton stub and its engine worker: typed messages over one socket.

The stub (`serving/engine_worker.py`) creates a connected unix socket pair and hands one end to the
worker it starts (`tandem-engine`, `backend/worker/host.py`) as an inherited file descriptor: no path
in the file system, so no other process can connect (more private than the unit's 0700 control dir).

Framing: every message is one msgpack document (msgspec, a tagged union of the Structs below) behind a
4-byte little-endian length. Contract of `Channel`:
- `send(msg)` never blocks its caller: it writes the frame at once when the socket takes it and
  nothing is queued, else queues it for the channel's writer thread. A peer that stopped reading
  (SIGSTOP) therefore stalls only that writer thread, never an execute thread of Triton or an engine
  loop.
- `recv()` blocks for the next message and returns None at end of stream: the peer exited, crashed or
  closed its end. That is how each side learns of the other's death at once (no timeout involved).
- A malformed frame is a `ChannelError` (a bug: the two ends run the same code).

Who sends what (docs/architecture.md, "Processes"):
    stub -> worker: Init (once, first), Submit (a validated request), Cancel, Stop
    worker -> stub: Ready (once, after Init) or Fail(req_id=0) if the engine could not start,
                    Reply (response outputs, `final` on the last), Fail (one request's error),
                    Beat (every `beat_s`: the engine loop's age and the metrics recorded since the
                    last Beat)
"""

from __future__ import annotations

import contextlib
import enum
import logging
import queue
import socket
import struct
import threading
from typing import Any

import msgspec
import numpy as np

from tandem.backend.metrics import MetricsSink

log = logging.getLogger("tandem")

_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 30


class EngineKind(enum.StrEnum):
    """Which engine a worker runs (Init.kind; `tandem-engine --kind`)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MONO = "mono"
    VOICES = "voices"  # the voice registrar (backend/voices/registrar.py)


# A worker's exit status when P holds ABORT_ACKs it cannot prove: its death (the free slot lock) and
# its restart (a new instance id) are the proof (docs/failure-semantics.md); the stub restarts it.
EXIT_FOR_PROOF = 70


class ChannelError(Exception):
    """A frame that does not decode: the two ends disagree on the protocol."""


class Array(msgspec.Struct, frozen=True):
    """A numpy array on the wire (C order); `dtype` "BYTES" is one UTF-8 string in `data`."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, a: np.ndarray) -> Array:
        a = np.ascontiguousarray(a)
        return cls(a.dtype.str, tuple(int(n) for n in a.shape), a.tobytes())

    @classmethod
    def text(cls, s: str) -> Array:
        return cls("BYTES", (1,), s.encode())

    def numpy(self) -> np.ndarray:
        assert self.dtype != "BYTES", "a BYTES array has no numpy form here"
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)


class Init(msgspec.Struct, frozen=True, tag=True):
    """What the worker needs to build its engine: Triton's model arguments (`model_config` is the
    JSON text Triton gives `initialize`)."""

    model: str
    instance: str
    kind: EngineKind
    instance_kind: str  # Triton's "CPU" | "GPU"
    device_id: int
    model_config: str


class Ready(msgspec.Struct, frozen=True, tag=True):
    """The engine serves. `cfg`: the decoder's ModelConfig fields (the stub validates requests with
    it); `pool_tokens`: the engine's pool size in tokens; `detail`: a line for the log."""

    pid: int
    cfg: dict[str, Any]
    pool_tokens: int
    detail: str


class Submit(msgspec.Struct, frozen=True, tag=True):
    """A validated request. Prompt engines (P, mono) get `prompt` and sampling; D gets `handoff`;
    the `voices` engine its inputs' bytes (`Array` "BYTES", `data` the raw bytes)."""

    req_id: int
    stream_id: int
    timings: dict[str, int]
    prompt: Array | None = None
    sampling: list[Any] = msgspec.field(default_factory=list)  # SamplingParams.to_wire()
    max_new_rows: int = 0
    handoff: str = ""
    inputs: dict[str, Array] = msgspec.field(default_factory=dict)  # `voices`: its raw BYTES inputs


class Cancel(msgspec.Struct, frozen=True, tag=True):
    """The stub no longer wants `req_id` (client cancelled, or the stub failed it during a stall):
    the engine drops it and frees what it holds."""

    req_id: int


class Stop(msgspec.Struct, frozen=True, tag=True):
    """Close the engine (its clients are told) and exit 0."""


class Reply(msgspec.Struct, frozen=True, tag=True):
    """One response of `req_id`, in the engine's terms (the stub names the Triton tensors:
    serving/triton_io.py `reply_tensors`); `final` ends the request.

    D's chunk: `rows` and the codec window it sounds (`frames` [N, K], `window` [3]); the monolithic
    engine's chunk: `rows` and `audio` (PCM); P's one reply: `handoff` (JSON); the voice
    registrar's: `result` (JSON). `timings` is the
    stream's per-stage stamps (JSON) on a final chunk, "" otherwise."""

    req_id: int
    final: bool
    rows: Array | None = None
    frames: Array | None = None
    window: Array | None = None
    audio: Array | None = None
    timings: str = ""
    handoff: str = ""
    result: str = ""  # the `voices` engine's one answer (JSON)


class Fail(msgspec.Struct, frozen=True, tag=True):
    """`req_id`'s one error (`code`: an ErrorCode value; `message` already starts with it);
    req_id 0: the engine could not start."""

    req_id: int
    code: str
    message: str


class Beat(msgspec.Struct, frozen=True, tag=True):
    """The worker is alive. `loop_age_s`: time since its engine loop last began an iteration (a
    loop stuck in a device call shows here while the process still answers). Metrics recorded since
    the last Beat: gauges (last value), counter increments (summed), histogram samples."""

    loop_age_s: float
    sets: list[tuple[str, dict[str, str], float]] = []
    incs: list[tuple[str, dict[str, str], float]] = []
    observes: list[tuple[str, dict[str, str], float]] = []

    def replay(self, sink: MetricsSink) -> None:
        """Publish this Beat's metrics through `sink` (the stub's: Triton's metrics)."""
        for name, labels, value in self.sets:
            sink.set(name, value, **labels)
        for name, labels, value in self.incs:
            sink.inc(name, value, **labels)
        for name, labels, value in self.observes:
            sink.observe(name, value, **labels)


Message = Init | Ready | Submit | Cancel | Stop | Reply | Fail | Beat

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class Channel:
    """One end of the stub<->worker socket. Thread-safe `send`; `recv` from one thread only."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self._sock = sock
        self._name = name
        self._out: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()  # orders direct writes against the writer thread's
        self._queued = 0  # frames handed to the writer thread and not yet written
        self._writer = threading.Thread(target=self._write_loop, name=f"{name}-writer", daemon=True)
        self._writer.start()

    def send(self, msg: Message) -> None:
        """Send `msg` without blocking: written at once when nothing is queued and the socket takes
        it (one syscall, no thread hand-off), else queued for the writer thread behind what is
        already queued (order is kept). Dropped once the channel is closed."""
        if self._closed:
            return
        body = _encoder.encode(msg)
        frame = _LEN.pack(len(body)) + body
        with self._lock:
            if not self._queued:
                try:
                    n = self._sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    n = 0
                except OSError:  # the peer is gone; its reader sees EOF and handles it
                    self._closed = True
                    return
                if n == len(frame):
                    return
                frame = frame[n:]
            self._queued += 1
            self._out.put(frame)

    def recv(self) -> Message | None:
        """The next message, or None at end of stream (the peer is gone)."""
        head = self._read(_LEN.size)
        if head is None:
            return None
        (n,) = _LEN.unpack(head)
        if n > MAX_FRAME:
            raise ChannelError(f"{self._name}: frame of {n} bytes")
        body = self._read(n)
        if body is None:
            return None
        try:
            return _decoder.decode(body)
        except msgspec.DecodeError as exc:
            raise ChannelError(f"{self._name}: undecodable frame: {exc}") from None

    def _read(self, n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            try:
                part = self._sock.recv(n - len(buf))
            except OSError:
                return None
            if not part:
                return None
            buf += part
        return bytes(buf)

    def _write_loop(self) -> None:
        while True:
            frame = self._out.get()
            if frame is None:
                return
            try:
                self._sock.sendall(frame)
            except OSError:  # the peer is gone; its reader sees EOF and handles it
                self._closed = True
                return
            with self._lock:
                self._queued -= 1

    def close(self) -> None:
        """Send what is queued (the writer finishes its queue), then shut the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._out.put(None)
        if threading.current_thread() is not self._writer:
            self._writer.join(2.0)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
