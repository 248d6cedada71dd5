"""A client helper for the `tts` / `tts_mono` contract over gRPC streaming.

Sets the stream id (Triton `sequence_id`) for the user, sends one request per stream, and collects
every response: generated rows, audio, the TIMINGS stamps, and client-side times (first audio,
tokens/s after the first response). Used by the CLI, the tests and the benchmark.

`TTSClient.speak` speaks a whole text as a speech session does (`gateway/session.py`): its segments,
one stream each, two in flight (the second on a connection of its own), results in order.

Errors: a stream's error reaches the callback as a message only (gRPC streaming drops the status of
an in-stream error). `StreamResult.error_code` is its code by `serving.client_errors.classify` (tandem's
bracketed code behind Triton's `in ensemble 'tts', ` prefix, Triton core's known messages, the gRPC
status of a broken stream) and `StreamResult.error` the message as `[CODE] detail` without Triton's
prefixes, the same for `tts` and `tts_mono`.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from tandem.gateway.errors import ClientCode, classify
from tandem.gateway.session import run_pipelined, segments
from tandem.wire import contract as wire

_ids = itertools.count(1)


def next_stream_id() -> int:
    """Unique per process run: pid in the high bits, a counter below."""
    return ((os.getpid() & 0xFFFF) << 32) | next(_ids)


@dataclass
class StreamResult:
    stream_id: int
    rows: np.ndarray | None = None  # int64 [N, W]
    audio: np.ndarray | None = None  # float32 [S]
    timings: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # "[CODE] detail" (module docstring)
    error_code: ClientCode | None = None
    sent_ns: int = 0
    first_response_ns: int = 0  # the first response with rows
    first_audio_ns: int = 0  # the first response with audio samples (later with a codec's lookahead)
    done_ns: int = 0
    responses: int = 0
    response_ns: list[int] = field(default_factory=list)
    response_rows: list[int] = field(default_factory=list)
    response_samples: list[int] = field(default_factory=list)  # audio samples of each response

    @property
    def ttfa_ms(self) -> float:
        """Time to first audio: send -> the first response carrying audio samples (the first one with
        rows when the responses carry no audio at all)."""
        first = self.first_audio_ns or self.first_response_ns
        return (first - self.sent_ns) / 1e6 if first else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Rows/s after the first response (the first one's rows are not a rate)."""
        n = 0 if self.rows is None else self.rows.shape[0]
        first_rows = self.response_rows[0] if self.response_rows else 0
        span = (self.done_ns - self.first_response_ns) / 1e9
        return (n - first_rows) / span if span > 0 and n > first_rows else float("nan")

    def below_floor(self, rows_per_second: float, rtf: float = 0.5) -> bool:
        """The unit's rule (`tandem_streams_below_floor_total`) seen from here: rows/s after the first
        response under the floor, the codec's `rows_per_second` of audio over the RTF target."""
        rate = self.tokens_per_s
        return rate == rate and rate < rows_per_second / rtf  # nan (one response): no rate to judge

    def playback_stalls(self, sample_rate: int) -> tuple[int, float]:
        """(stalls, seconds stalled) of a listener who starts playing the first audio on arrival and
        plays each response's audio as it comes: a stall is a response that arrived after the audio
        before it had all been played."""
        stalls, stalled, played_until = 0, 0.0, None
        for at_ns, samples in zip(self.response_ns, self.response_samples, strict=True):
            at = at_ns / 1e9
            if played_until is None:
                if samples:
                    played_until = at + samples / sample_rate
                continue
            if at > played_until:
                stalls, stalled = stalls + 1, stalled + (at - played_until)
                played_until = at
            played_until += samples / sample_rate
        return stalls, stalled


@dataclass
class SpeechResult:
    """A text spoken by `TTSClient.speak`: its segments and each one's stream, in order; a failed
    segment's result is the last (no segment after it was started)."""

    segments: list[str]
    results: list[StreamResult]

    @property
    def audio(self) -> np.ndarray:
        parts = [r.audio for r in self.results if r.audio is not None]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)

    @property
    def rows(self) -> int:
        """Rows generated over every segment (the usage)."""
        return sum(0 if r.rows is None else int(r.rows.shape[0]) for r in self.results)

    @property
    def error(self) -> str | None:
        return next((r.error for r in self.results if r.error), None)


# The one-element inputs a request may carry besides PROMPT, by name (`wire/contract.py`).
SCALAR_INPUTS = {t.name: t for t in (wire.TEXT, wire.VOICE, *wire.SAMPLING)}


def scalar_input(spec: wire.TensorSpec, value: Any) -> grpcclient.InferInput:
    """`value` (a str for BYTES) as the [1]-shaped input `spec`."""
    arr = np.array([value.encode() if isinstance(value, str) else value], dtype=spec.dtype.numpy)
    t = grpcclient.InferInput(spec.name, [1], spec.dtype.triton)
    t.set_data_from_numpy(arr)
    return t


def build_inputs(prompt: np.ndarray | None, **params: Any) -> list[grpcclient.InferInput]:
    """PROMPT (None: the request carries TEXT instead) plus any of MAX_TOKENS, TEMPERATURE, TOP_P,
    TOP_K, SEED, VOICE_ID, TEXT, VOICE, REPETITION_PENALTY given as keywords."""
    inputs: list[grpcclient.InferInput] = []
    if prompt is not None:
        inputs.append(_prompt_input(prompt))
    inputs += [
        scalar_input(SCALAR_INPUTS[name], value) for name, value in params.items() if value is not None
    ]
    return inputs


def _prompt_input(prompt: np.ndarray) -> grpcclient.InferInput:
    """PROMPT as given: INT64, or INT32/FP32 sent as they are (the server refuses them, by name)."""
    prompt_arr = np.asarray(prompt)
    dtype = next((d for d in (wire.INT64, wire.INT32, wire.FP32) if d.numpy == prompt_arr.dtype), wire.INT64)
    p = grpcclient.InferInput(wire.PROMPT.name, list(prompt_arr.shape), dtype.triton)
    p.set_data_from_numpy(prompt_arr)
    return p


class TTSClient:
    """One gRPC stream carrying one TTS stream at a time.

    gRPC stream errors reach tritonclient's callback without the request id, so an error can only be
    attributed when a single stream is in flight on the connection. Concurrency = several clients
    (`run_concurrent`), which is also how independent listeners connect.
    """

    def __init__(self, url: str, model: str = "tts") -> None:
        self.url = url
        self.model = model
        self._client = grpcclient.InferenceServerClient(url)
        self._results: dict[str, StreamResult] = {}
        self._done: queue.Queue[str] = queue.Queue()
        self._lock = threading.Lock()
        self._client.start_stream(callback=self._on_response)

    def model_parameters(self) -> dict[str, str]:
        """The model config's parameters (protobuf JSON leaves out empty strings: they read as "")."""
        cfg = self._client.get_model_config(self.model, as_json=True)["config"]
        return {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}

    def _on_response(self, result: Any = None, error: Any = None) -> None:
        now = time.time_ns()
        if error is not None:
            with self._lock:
                pending = [k for k, r in self._results.items() if r.done_ns == 0]
                if not pending:
                    return
                key = pending[0]
                r = self._results[key]
                err = classify(str(error.message()), error.status())
                r.error, r.error_code = str(err), err.code
                r.done_ns = now
            self._done.put(key)
            return
        resp = result.get_response()
        key = resp.id
        with self._lock:
            r = self._results[key]
            final = (
                resp.parameters["triton_final_response"].bool_param
                if "triton_final_response" in resp.parameters
                else False
            )
            tokens = result.as_numpy(wire.TOKENS.name)
            audio = result.as_numpy(wire.AUDIO.name)
            if tokens is not None:
                r.responses += 1
                if not r.first_response_ns:
                    r.first_response_ns = now
                r.response_ns.append(now)
                r.response_rows.append(int(tokens.shape[0]))
                r.response_samples.append(0 if audio is None else int(audio.size))
                r.rows = tokens if r.rows is None else np.concatenate([r.rows, tokens])
                if audio is not None and audio.size and not r.first_audio_ns:
                    r.first_audio_ns = now
                if audio is not None:
                    r.audio = audio if r.audio is None else np.concatenate([r.audio, audio])
            timings = result.as_numpy(wire.TIMINGS.name)
            if timings is not None and len(timings) and timings[0]:
                r.timings.update(json.loads(timings[0]))
            if final:
                r.done_ns = now
        if final:
            self._done.put(key)

    def send(self, prompt: np.ndarray | None, stream_id: int | None = None, **params: Any) -> str:
        """Start one stream; returns its request id (a key for `wait`)."""
        sid = stream_id or next_stream_id()
        key = str(sid)
        with self._lock:
            if any(r.done_ns == 0 for r in self._results.values()):
                raise RuntimeError("one stream at a time per TTSClient; use several clients for concurrency")
        r = StreamResult(stream_id=sid, sent_ns=time.time_ns())
        r.timings["client_send"] = r.sent_ns
        with self._lock:
            self._results[key] = r
        self._client.async_stream_infer(
            self.model,
            build_inputs(prompt, **params),
            request_id=key,
            sequence_id=sid,
            sequence_start=True,
            sequence_end=True,
            enable_empty_final_response=True,
        )
        return key

    def wait(self, keys: list[str], timeout_s: float = 120.0) -> list[StreamResult]:
        deadline = time.monotonic() + timeout_s
        remaining = set(keys)
        while remaining:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(remaining)} streams unfinished after {timeout_s} s")
            try:
                remaining.discard(self._done.get(timeout=left))
            except queue.Empty:
                continue
        with self._lock:
            return [self._results[k] for k in keys]

    def run(self, prompt: np.ndarray | None, timeout_s: float = 120.0, **params: Any) -> StreamResult:
        return self.wait([self.send(prompt, **params)], timeout_s)[0]

    def speak(
        self,
        text: str,
        voice: str | None = None,
        seed: int | None = None,
        timeout_s: float = 300.0,
        **params: Any,
    ) -> SpeechResult:
        """`text` spoken whole: one TEXT stream per segment with the same VOICE and SEED (and any
        other input of the contract in `params`), two in flight; stops at the first failed segment."""
        parts = segments(text)
        second = TTSClient(self.url, self.model)  # the stream in flight beside this one's
        clients = (self, second)

        def start(part: str, index: int) -> tuple[TTSClient, str]:
            client = clients[index % 2]
            inputs: dict[str, Any] = {wire.TEXT.name: part, wire.VOICE.name: voice, wire.SEED.name: seed}
            return client, client.send(None, **inputs, **params)

        def finish(handle: tuple[TTSClient, str]) -> StreamResult:
            return handle[0].wait([handle[1]], timeout_s)[0]

        try:
            results = list(run_pipelined(parts, start, finish, stop=lambda r: r.error is not None))
        finally:
            second.close()
        return SpeechResult(parts, results)

    def close(self, cancel: bool = False) -> None:
        self._client.stop_stream(cancel_requests=cancel)
        self._client.close()

    def __enter__(self) -> TTSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_concurrent(
    url: str, model: str, jobs: list[tuple[np.ndarray, dict[str, Any]]], timeout_s: float = 300.0
) -> list[StreamResult]:
    """Run every (prompt, params) job at once, one connection each; results in job order."""
    clients = [TTSClient(url, model) for _ in jobs]
    try:
        keys = [c.send(p, **kw) for c, (p, kw) in zip(clients, jobs, strict=True)]
        return [c.wait([k], timeout_s)[0] for c, k in zip(clients, keys, strict=True)]
    finally:
        for c in clients:
            c.close()
