"""The vocoder step's batcher, with a stand-in for triton_python_backend_utils: chunks of many
streams queued while the codec is busy go through one decode call; every request gets exactly one
FINAL response, in order; a bad request gets its error and loses nothing else."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tandem.backend.codec.base import CodecSpec, CodecWindow
from tandem.backend.codec.config import VocoderConfig
from tandem.backend.codec.reference import ReferenceVocoder
from tandem.serving.chunk_render import VocoderBatcher


class _Tensor:
    def __init__(self, name: str, value: Any) -> None:
        self.name, self.value = name, value

    def as_numpy(self) -> Any:
        return self.value


@dataclass
class _Response:
    output_tensors: list[_Tensor] | None = None
    error: Any = None

    def get(self, name: str) -> Any:
        return next(t.value for t in self.output_tensors or [] if t.name == name)


class _Error:
    """pb_utils.TritonError's codes that tandem's errors map to (serving/triton_io.triton_error)."""

    INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL, ALREADY_EXISTS, NOT_FOUND = range(6)

    def __init__(self, message: str, code: int) -> None:
        self.message, self.code = message, code


class _PB:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    TritonError = _Error
    Tensor = _Tensor

    @staticmethod
    def InferenceResponse(output_tensors: list[_Tensor] | None = None, error: Any = None) -> _Response:
        return _Response(output_tensors, error)

    @staticmethod
    def get_input_tensor_by_name(request: _Request, name: str) -> _Tensor | None:
        return _Tensor(name, request.inputs[name]) if name in request.inputs else None


@dataclass
class _Sender:
    sent: list[tuple[_Response, int]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def send(self, response: _Response, flags: int = 0) -> None:
        self.sent.append((response, flags))
        self.done.set()


@dataclass
class _Request:
    inputs: dict[str, Any]
    sender: _Sender = field(default_factory=_Sender)

    def get_response_sender(self) -> _Sender:
        return self.sender


class _GatedCodec:
    """The reference codec, held at its first call until released; records each call's size."""

    def __init__(self) -> None:
        self.inner = ReferenceVocoder(VocoderConfig())
        self.calls: list[int] = []
        self.gate = threading.Event()
        self.entered = threading.Event()

    @property
    def spec(self) -> CodecSpec:
        return self.inner.spec

    def decode(self, windows: list[CodecWindow]) -> list[np.ndarray]:
        self.entered.set()
        self.gate.wait(10)
        self.calls.append(len(windows))
        return self.inner.decode(windows)


def _request(rows: np.ndarray, first: int, timings: str = "") -> _Request:
    w = CodecWindow(rows, first, first, first + rows.shape[0])
    inputs = {
        "TOKENS": rows,
        "CODES": w.frames,
        "WINDOW": w.as_array(),
        "TIMINGS": np.array([timings.encode()]),
    }
    return _Request(inputs)


def test_chunks_queued_while_the_codec_is_busy_share_one_call() -> None:
    codec = _GatedCodec()
    batcher = VocoderBatcher(_PB(), codec)
    rng = np.random.default_rng(0)
    first = _request(rng.integers(0, 1024, size=(4, 4)), 0)
    batcher.submit([first])
    assert codec.entered.wait(10)  # the codec is busy with the first chunk
    later = [_request(rng.integers(0, 1024, size=(8, 4)), 4 * i) for i in range(1, 6)]
    bad = _Request({"TOKENS": np.zeros((2, 4), dtype=np.int64)})  # no CODES / WINDOW
    batcher.submit([*later[:3], bad, *later[3:]])
    codec.gate.set()
    for r in [first, *later, bad]:
        assert r.sender.done.wait(10)
    batcher.close()
    assert codec.calls == [1, 5]  # the five queued meanwhile went through one call
    for r in [first, *later]:
        [(response, flags)] = r.sender.sent
        assert flags == _PB.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.error is None
        w = CodecWindow.from_arrays(r.inputs["CODES"], r.inputs["WINDOW"])
        expected = codec.inner.synthesize(r.inputs["TOKENS"], w.emit_from)
        np.testing.assert_array_equal(response.get("AUDIO"), expected)
        np.testing.assert_array_equal(response.get("TOKENS_OUT"), r.inputs["TOKENS"])
    [(response, flags)] = bad.sender.sent
    assert response.error is not None and flags == _PB.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def test_the_first_sounding_chunk_stamps_first_audio() -> None:
    codec = _GatedCodec()
    codec.gate.set()
    batcher = VocoderBatcher(_PB(), codec)
    rows = np.zeros((3, 4), dtype=np.int64)
    a, b = _request(rows, 0, json.dumps({"d_entry": 1})), _request(rows, 3)
    batcher.submit([a, b])
    assert a.sender.done.wait(10) and b.sender.done.wait(10)
    batcher.close()
    stamped = json.loads(a.sender.sent[0][0].get("TIMINGS_OUT")[0])
    assert stamped["d_entry"] == 1 and "first_audio" in stamped
    assert b.sender.sent[0][0].get("TIMINGS_OUT")[0] == b""
