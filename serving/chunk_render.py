"""The vocoder's batched execute: many streams' chunks in one codec call.

Its tensors are read and written by `triton_io.py` (`read_chunk`, `chunk_tensors`), the one module
that touches a Triton tensor. D's and `tts_mono`'s chunks are rendered in their
engine workers (`backend/worker/host.py`: `CODES`/`WINDOW` for the vocoder step, `AUDIO` for mono).
- `VocoderBatcher`: the `vocoder` step, stateless: the windows of every chunk queued meanwhile (of
  many streams) are decoded in one `Codec.decode` call, and each request's one response carries
  `TOKENS_OUT`, `AUDIO` and `TIMINGS_OUT`.
`pb` is `triton_python_backend_utils`, passed in so this module imports without Triton.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.backend.codec.base import Codec, CodecWindow
from tandem.backend.metrics import MetricsSink
from tandem.backend.settings import MAX_BATCH
from tandem.backend.timing import first_audio_s, now_ns
from tandem.serving import triton_io as io

log = logging.getLogger("tandem")


def _stamp_first_audio(text: str, window: CodecWindow, metrics: MetricsSink | None) -> str:
    """The stream's first sounding chunk stamps `first_audio` into the stamps D sent with it (D sends
    them with that chunk and the last) and observes the unit's `tandem_first_audio_seconds`."""
    if not window.first_sounding:
        return text
    stamps = json.loads(text) if text else {}
    stamps.setdefault("first_audio", now_ns())
    if metrics is not None and (seconds := first_audio_s(stamps)) is not None:
        metrics.observe("tandem_first_audio_seconds", seconds)
    return json.dumps(stamps, separators=(",", ":"))


def _decode_each(codec: Codec, windows: list[CodecWindow]) -> list[np.ndarray | BaseException]:
    """One batched decode; if it fails, window by window, so only a bad window's request fails."""
    try:
        return list(codec.decode(windows))
    except Exception:
        log.exception("vocoder: a batch of %d windows failed; decoding them one by one", len(windows))
    out: list[np.ndarray | BaseException] = []
    for w in windows:
        try:
            out.append(codec.decode([w])[0])
        except Exception as exc:
            out.append(exc)
    return out


@dataclass(frozen=True)
class _Job:
    sender: Any  # the request's decoupled response sender
    rows: np.ndarray
    window: CodecWindow
    timings: str


class VocoderBatcher:
    """The `vocoder` step (decoupled): `submit` only parses and enqueues; one thread decodes all the
    chunks queued meanwhile — of every stream — in one `Codec.decode` call and answers each request
    with exactly one FINAL response, in arrival order (so a stream's chunks stay in order).

    Why not Triton's dynamic batcher: with `max_batch_size: 0` (the ensemble's tensors carry no batch
    dimension) it executes requests one by one. The thread is the only user of the codec; a request
    whose tensors or window are bad gets its error at once, the others their audio.
    """

    def __init__(
        self, pb: Any, codec: Codec, max_windows: int = MAX_BATCH, metrics: MetricsSink | None = None
    ) -> None:
        self._pb = pb
        self._codec = codec
        self._metrics = metrics  # tandem_first_audio_seconds of the `tts` streams
        self._max = max_windows
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tandem-vocoder", daemon=True)
        self._thread.start()

    def submit(self, requests: list[Any]) -> None:
        """Called by Triton's execute thread."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                rows, window, text = io.read_chunk(self._pb, request)
            except Exception as exc:
                self._fail(sender, exc)
                continue
            self._queue.put(_Job(sender, rows, window, text))

    def _fail(self, sender: Any, exc: BaseException) -> None:
        pb = self._pb
        sender.send(
            pb.InferenceResponse(error=io.triton_error(pb, exc)),
            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while len(jobs) < self._max:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                jobs.append(more)
            try:
                self._answer(jobs)
            except Exception:  # a sender that cannot send (client gone): the others are answered
                log.exception("vocoder: answering a batch of %d chunks failed", len(jobs))

    def _answer(self, jobs: list[_Job]) -> None:
        pb = self._pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for job, audio in zip(jobs, _decode_each(self._codec, [j.window for j in jobs]), strict=True):
            try:
                if isinstance(audio, BaseException):
                    self._fail(job.sender, audio)
                    continue
                stamps = _stamp_first_audio(job.timings, job.window, self._metrics)
                outputs = io.chunk_tensors(pb, job.rows, audio, stamps)
                job.sender.send(pb.InferenceResponse(output_tensors=outputs), flags=flags)
            except Exception:
                log.exception("vocoder: could not answer a chunk")

    def close(self) -> None:
        """Answer what is queued, then stop the thread (Triton's finalize)."""
        self._queue.put(None)
        self._thread.join(timeout=30)
