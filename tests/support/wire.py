"""Requests as bytes on the wire: tritonclient's own gRPC service stub, fed protobufs built by hand.

tritonclient's `InferInput` refuses a tensor whose data disagrees with its declared shape or datatype
before anything is sent, so the fuzz and abuse tests build the `ModelInferRequest` protobufs
tritonclient would build (`test_fuzz.py` checks that a well-formed one is byte-identical to
tritonclient's) and send them over `GRPCInferenceServiceStub.ModelStreamInfer`: any datatype string,
any shape (negative, huge, empty), any raw content (too short, too long, broken BYTES length
prefixes), any sequence flags.

`Connection` is one gRPC channel carrying one bidirectional stream; `call()` sends one request and
waits for its outcome: the responses (the last with Triton's final flag) or an error, or a timeout.
One request at a time per connection, so an error (gRPC stream errors carry no request id) belongs
to the request in flight; anything that arrives while none is in flight is kept in `strays`.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

# numpy dtype -> Triton datatype name (the ones tritonclient maps; BYTES is handled apart).
_TRITON = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.uint16): "UINT16",
    np.dtype(np.uint32): "UINT32",
    np.dtype(np.uint64): "UINT64",
    np.dtype(np.int8): "INT8",
    np.dtype(np.int16): "INT16",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.float16): "FP16",
    np.dtype(np.float32): "FP32",
    np.dtype(np.float64): "FP64",
}
NUMPY = {v: k for k, v in _TRITON.items()}


@dataclass(frozen=True)
class WireTensor:
    """One input as the server receives it: a name, a datatype string, a shape and raw bytes that
    need not agree with each other."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes

    def __repr__(self) -> str:  # hypothesis prints failing examples; a 128 KiB prompt is no use there
        head = self.raw[:16].hex()
        return f"WireTensor({self.name!r}, {self.datatype!r}, {self.shape}, {len(self.raw)} B: {head}..)"

    @staticmethod
    def of(name: str, arr: np.ndarray) -> WireTensor:
        """A well-formed tensor from a numpy array (object/bytes arrays become BYTES)."""
        if arr.dtype.kind in "OSU":
            return WireTensor(name, "BYTES", tuple(arr.shape), serialize_bytes(arr.reshape(-1).tolist()))
        return WireTensor(name, _TRITON[arr.dtype], tuple(arr.shape), np.ascontiguousarray(arr).tobytes())


def serialize_bytes(items: Sequence[bytes | str]) -> bytes:
    """Triton's BYTES wire format: each element as a little-endian uint32 length, then its bytes."""
    out = bytearray()
    for item in items:
        b = item.encode() if isinstance(item, str) else bytes(item)
        out += struct.pack("<I", len(b)) + b
    return bytes(out)


def request(
    model: str,
    tensors: Sequence[WireTensor],
    request_id: str,
    sequence_id: int | str = 0,
    start: bool = False,
    end: bool = False,
) -> service_pb2.ModelInferRequest:
    """The protobuf tritonclient's `async_stream_infer` sends (with `enable_empty_final_response`)."""
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    if isinstance(sequence_id, str):
        if sequence_id:
            req.parameters["sequence_id"].string_param = sequence_id
    elif sequence_id != 0:
        req.parameters["sequence_id"].int64_param = sequence_id
    if sequence_id not in (0, ""):
        req.parameters["sequence_start"].bool_param = start
        req.parameters["sequence_end"].bool_param = end
    req.parameters["triton_enable_empty_final_response"].bool_param = True
    for t in tensors:
        tensor = service_pb2.ModelInferRequest().InferInputTensor(name=t.name, datatype=t.datatype)
        tensor.shape.extend(t.shape)
        req.inputs.extend([tensor])
        req.raw_input_contents.extend([t.raw])
    return req


@dataclass
class Response:
    request_id: str
    final: bool
    outputs: dict[str, np.ndarray]  # numeric outputs decoded; BYTES outputs as raw bytes in a 0-d array


@dataclass
class Outcome:
    responses: list[Response] = field(default_factory=list)
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def finished(self) -> bool:
        """Terminal: an error, or a response with the final flag."""
        return self.error is not None or any(r.final for r in self.responses)


def _decode(resp: service_pb2.ModelInferResponse) -> Response:
    final = "triton_final_response" in resp.parameters and resp.parameters["triton_final_response"].bool_param
    outputs: dict[str, np.ndarray] = {}
    for i, out in enumerate(resp.outputs):
        raw = resp.raw_output_contents[i] if i < len(resp.raw_output_contents) else b""
        if out.datatype in NUMPY:
            outputs[out.name] = np.frombuffer(raw, dtype=NUMPY[out.datatype]).reshape(tuple(out.shape))
        else:
            outputs[out.name] = np.array(raw, dtype=object)
    return Response(resp.id, bool(final), outputs)


class Connection:
    """One channel, one `ModelStreamInfer` stream, read by a background thread (unless `read=False`:
    then nothing is ever read, and the server's responses back up behind HTTP/2 flow control)."""

    def __init__(self, url: str, read: bool = True) -> None:
        self._channel = grpc.insecure_channel(url)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        self._outbox: queue.Queue[service_pb2.ModelInferRequest | None] = queue.Queue()
        self._events: queue.Queue[Response | str | BaseException] = queue.Queue()
        self.strays: list[Response | str] = []
        self.log: list[tuple[float, Response | str]] = []  # every event, with time.monotonic() on arrival
        self._call = self._stub.ModelStreamInfer(self._requests())
        self._reader: threading.Thread | None = None
        if read:
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()

    def _requests(self) -> Iterator[service_pb2.ModelInferRequest]:
        while (req := self._outbox.get()) is not None:
            yield req

    def _read(self) -> None:
        try:
            for msg in self._call:
                ev = msg.error_message if msg.error_message else _decode(msg.infer_response)
                self.log.append((time.monotonic(), ev))
                self._events.put(ev)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._events.put(exc)

    def send(self, req: service_pb2.ModelInferRequest) -> None:
        """Send without waiting for anything (the abuse tests' clients that never look back)."""
        self._outbox.put(req)

    def call(self, req: service_pb2.ModelInferRequest, timeout_s: float) -> Outcome:
        """Send `req` and wait for its final response or error, at most `timeout_s`."""
        assert self._reader is not None, "call() needs a reading connection"
        self.collect_strays()
        out = Outcome()
        t0 = time.monotonic()
        self._outbox.put(req)
        deadline = t0 + timeout_s
        while not out.finished:
            left = deadline - time.monotonic()
            if left <= 0:
                out.timed_out = True
                break
            try:
                ev = self._events.get(timeout=left)
            except queue.Empty:
                continue
            if isinstance(ev, BaseException):
                out.error = f"[stream broken] {ev}"
            elif isinstance(ev, str):
                out.error = ev
            elif ev.request_id != req.id:
                self.strays.append(ev)
            else:
                out.responses.append(ev)
        out.seconds = time.monotonic() - t0
        return out

    def collect_strays(self, wait_s: float = 0.0) -> list[Response | str]:
        """Whatever arrived while no request was waiting (a response after a final one, say)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                ev = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return self.strays
            self.strays.append(str(ev) if isinstance(ev, BaseException) else ev)

    def close(self) -> None:
        """Half-close the stream (no more requests), then drop the channel without waiting."""
        self._outbox.put(None)
        self._call.cancel()
        self._channel.close()
