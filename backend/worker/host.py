"""One engine behind a channel: the body of a `tandem-engine` worker process.

A model instance's stub (`serving/engine_worker.py`) starts this process and talks to it over the
channel (`backend/worker/channel.py`). Its life:

    read Init -> build the decoder on the instance's device and the engine (P, D or monolithic)
    -> Ready (or Fail(req_id=0) and exit 1)
    -> serve: the reader thread turns each Submit into an engine request whose sink answers through
       the channel (Reply / Fail), each Cancel into that sink's `cancelled()`; the beat thread sends a
       Beat every `worker.beat_s` with the engine loop's age and the metrics recorded meanwhile
    -> Stop: close the engine (its clients are told) and exit 0; end of stream (the stub is gone):
       close the engine and exit 0.

Nothing here knows Triton: the stub validated the request already (the engine checks again where a
bad value could hurt others), and renders each Reply's arrays into Triton tensors. P's exit for proof
(`EXIT_FOR_PROOF` when it holds ABORT_ACKs it cannot prove) ends this process only; the stub sees the
exit and starts a new worker, whose new transfer instance id D takes as proof.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from tandem.backend.codec.base import Codec, CodecWindow
from tandem.backend.engines.handoff import Handoff
from tandem.backend.engines.stream import Chunk
from tandem.backend.errors import InvalidInput, TandemError
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.metrics import MetricsSink
from tandem.backend.settings import EngineSettings, parse_settings, triton_parameters
from tandem.backend.timing import Timings, first_audio_s
from tandem.backend.worker.channel import (
    EXIT_FOR_PROOF,
    Array,
    Cancel,
    Channel,
    EngineKind,
    Fail,
    Init,
    Ready,
    Reply,
    Stop,
    Submit,
)
from tandem.backend.worker.metrics import BeatMetrics

log = logging.getLogger("tandem")


class _Engine(Protocol):
    def start(self) -> None: ...

    def close(self) -> None: ...

    def submit(self, req: Any) -> None: ...

    def loop_age_s(self) -> float: ...


Render = Callable[[int, Chunk], Reply]


class RequestSink:
    """ChunkSink (D, mono) and HandoffSink (P) of one request: answers go out through the channel.
    Called by the engine's threads; after the final Reply or the Fail nothing more is sent."""

    def __init__(self, host: EngineHost, req_id: int, render: Render | None) -> None:
        self._host = host
        self.req_id = req_id
        self._render = render
        self._done = False
        self.cancel_requested = False  # set by the reader thread on Cancel

    def emit(self, chunk: Chunk) -> None:
        if self._done:
            return
        assert self._render is not None
        reply = self._render(self.req_id, chunk)
        self._finish(chunk.final)
        self._host.channel.send(reply)

    def send(self, handoff: Handoff) -> None:
        if self._done:
            return
        self._finish(True)
        self._host.channel.send(Reply(self.req_id, True, handoff=handoff.to_json()))

    def fail(self, error: TandemError) -> None:
        if self._done:
            return
        self._finish(True)
        self._host.channel.send(Fail(self.req_id, error.code.value, str(error)))

    def answer(self, result: dict[str, object]) -> None:
        """VoiceSink: the one answer of a `voices` request (JSON in RESULT)."""
        if self._done:
            return
        self._finish(True)
        self._host.channel.send(Reply(self.req_id, True, result=json.dumps(result)))

    def cancelled(self) -> bool:
        return self.cancel_requested

    def _finish(self, final: bool) -> None:
        if final:
            self._done = True
            self._host.forget(self.req_id)


def _timings_text(chunk: Chunk) -> str:
    return Timings(chunk.timings.as_dict() if chunk.timings else {}).to_json()


class EngineHost:
    """Builds one engine from an Init and serves it over `channel` until Stop or end of stream."""

    def __init__(self, channel: Channel, init: Init) -> None:
        self.channel = channel
        self.init = init
        self.settings: EngineSettings = parse_settings(triton_parameters(json.loads(init.model_config)))
        self.metrics = BeatMetrics()
        self._sinks: dict[int, RequestSink] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self.engine: _Engine | None = None
        self._render: Render | None = None

    # ---- start-up --------------------------------------------------------------------------------

    def build(self) -> Ready:
        """Decoder on the instance's device, then the engine, started. Raises whatever failed."""
        from tandem.backend.device import resolve_device
        from tandem.backend.engines.parts import build_csm, build_decoder, csm_row_step, size_from_device

        i = self.init
        device = resolve_device(self.settings.device, i.instance_kind, i.device_id)
        if i.kind == EngineKind.VOICES:
            return self._build_voices(device)
        csm = build_csm(self.settings, device)  # Sesame CSM: the backbone is the engine's decoder
        decoder = build_decoder(self.settings, device) if csm is None else csm.backbone
        self.settings = size_from_device(self.settings, decoder)
        rows = None if csm is None else csm_row_step(csm, self.settings)
        if i.kind == EngineKind.PREFILL:
            from tandem.backend.engines.prefill import PrefillEngine

            slot = i.instance.replace(" ", "_")
            self.engine = PrefillEngine(decoder, self.settings, self.metrics, slot, _exit_for_proof, rows)
        elif i.kind == EngineKind.DECODE:
            from tandem.backend.engines.decode.engine import DecodeEngine

            self.engine = DecodeEngine(decoder, self.settings, self.metrics, rows)
            self._render = _render_decode
        else:
            from tandem.backend.engines.mono import MonoEngine
            from tandem.backend.engines.parts import make_codec

            codec = make_codec(self.settings, decoder.device)
            self.engine = MonoEngine(decoder, self.settings, self.metrics, rows)
            metrics = self.metrics
            self._render = lambda req_id, chunk: _render_mono(req_id, chunk, codec, metrics)
        self.engine.start()
        p = self.settings.pool
        return Ready(
            pid=os.getpid(),
            cfg=dataclasses.asdict(decoder.cfg),
            pool_tokens=p.num_pages * p.page_size,
            detail=f"{i.kind} engine on {device}",
        )

    def _build_voices(self, device: Any) -> Ready:
        """The `voices` engine: the codec's encoder on the instance's device, over the unit's store."""
        import torch

        from tandem.backend.codec.builder import build_encoder, codec_spec, layout
        from tandem.backend.text.frontend import builtin_voices, model_config
        from tandem.backend.voices.registrar import VoiceRegistrar
        from tandem.backend.voices.store import VoiceStore, resolve_dir

        s = self.settings
        if s.torch_threads > 0:
            torch.set_num_threads(s.torch_threads)
        spec = codec_spec(s)
        width = layout(spec.layout).frame_width(model_config(s).row_width)
        encoder = build_encoder(s, device)
        store = VoiceStore(resolve_dir(s.voices.dir, os.environ))  # the stub's environment, inherited
        self.engine = VoiceRegistrar(encoder, width, store, s.voices, builtin_voices(s))
        self.engine.start()
        detail = f"voices: {spec.kind} encoder on {device}, store {store.dir}"
        return Ready(pid=os.getpid(), cfg={}, pool_tokens=0, detail=detail)

    # ---- serving ---------------------------------------------------------------------------------

    def serve(self) -> int:
        """Reader loop on this thread, beats on another. Returns the process's exit status."""
        beat = threading.Thread(target=self._beat_loop, name="tandem-worker-beat", daemon=True)
        beat.start()
        while True:
            msg = self.channel.recv()
            if msg is None:
                log.warning("%s: the stub closed the channel (it exited): stopping", self.init.instance)
                break
            if isinstance(msg, Submit):
                self._submit(msg)
            elif isinstance(msg, Cancel):
                with self._lock:
                    sink = self._sinks.get(msg.req_id)
                if sink is not None:
                    sink.cancel_requested = True
            elif isinstance(msg, Stop):
                break
            else:
                log.error("%s: unexpected %s from the stub", self.init.instance, type(msg).__name__)
        self.close()
        return 0

    def close(self) -> None:
        self._stopped.set()
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:
                log.exception("%s: closing the engine failed", self.init.instance)
        self.channel.send(self.metrics.beat(0.0))  # the last counts
        self.channel.close()

    def forget(self, req_id: int) -> None:
        with self._lock:
            self._sinks.pop(req_id, None)

    def _submit(self, msg: Submit) -> None:
        sink = RequestSink(self, msg.req_id, self._render)
        with self._lock:
            self._sinks[msg.req_id] = sink
        try:
            assert self.engine is not None
            self.engine.submit(self._request(msg, sink))
        except TandemError as err:
            sink.fail(err)

    def _request(self, msg: Submit, sink: RequestSink) -> Any:
        timings = Timings(msg.timings)
        kind = self.init.kind
        if kind == EngineKind.VOICES:
            from tandem.backend.text.frontend import builtin_voices
            from tandem.backend.voices.registrar import VoiceJob
            from tandem.backend.voices.request import parse_voice_request

            raw = {name: a.data for name, a in msg.inputs.items()}
            req = parse_voice_request(raw, self.settings.voices, builtin_voices(self.settings))
            return VoiceJob(req, sink)
        if kind == EngineKind.DECODE:
            from tandem.backend.engines.decode.engine import DecodeRequest

            try:
                handoff = Handoff.from_json(msg.handoff)
            except ValueError as exc:
                raise InvalidInput(str(exc)) from None
            return DecodeRequest(msg.stream_id, handoff, sink, timings)
        if msg.prompt is None:
            raise InvalidInput("PROMPT is required")
        try:
            sampling = SamplingParams.from_wire(msg.sampling)
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed sampling parameters: {exc}") from None
        fields = {
            "stream_id": msg.stream_id,
            "prompt": msg.prompt.numpy().copy(),
            "sampling": sampling,
            "max_new_rows": msg.max_new_rows,
            "sink": sink,
            "timings": timings,
        }
        if kind == EngineKind.PREFILL:
            from tandem.backend.engines.prefill import PrefillRequest

            return PrefillRequest(**fields)
        from tandem.backend.engines.stream import EngineRequest

        return EngineRequest(**fields)

    def _beat_loop(self) -> None:
        interval = self.settings.worker.beat_s
        while not self._stopped.wait(interval):
            age = self.engine.loop_age_s() if self.engine is not None else 0.0
            self.channel.send(self.metrics.beat(age))


def _window(chunk: Chunk) -> CodecWindow:
    assert chunk.window is not None, "chunks of a decode batch always carry their codec window"
    return chunk.window


def _render_decode(req_id: int, chunk: Chunk) -> Reply:
    """D's chunk: the new rows and the codec window (frames with their context, and which of them this
    chunk sounds: backend/codec/base.py) the vocoder step decodes. The first sounding chunk carries the
    stamps so far too: the vocoder stamps `first_audio` into them and observes the unit's first audio."""
    w = _window(chunk)
    return Reply(
        req_id,
        chunk.final,
        rows=Array.of(chunk.rows),
        frames=Array.of(np.ascontiguousarray(w.frames, dtype=np.int64)),
        window=Array.of(w.as_array()),
        timings=_timings_text(chunk) if chunk.final or w.first_sounding else "",
    )


def _render_mono(req_id: int, chunk: Chunk, codec: Codec, metrics: MetricsSink) -> Reply:
    """The monolithic engine's chunk: the engine thread decodes its window with the model's codec; the
    first sounding window stamps `first_audio` once its audio exists (as the vocoder step does) and
    observes `tandem_first_audio_seconds`."""
    w = _window(chunk)
    audio = codec.decode([w])[0]
    if chunk.timings is not None and w.first_sounding:
        chunk.timings.mark("first_audio")
        if (seconds := first_audio_s(chunk.timings.as_dict())) is not None:
            metrics.observe("tandem_first_audio_seconds", seconds)
    return Reply(
        req_id,
        chunk.final,
        rows=Array.of(chunk.rows),
        audio=Array.of(np.asarray(audio, dtype=np.float32)),
        timings=_timings_text(chunk) if chunk.final else "",
    )


def _exit_for_proof(reason: str) -> None:
    """P holds ABORT_ACKs it cannot prove; at the limit its death (the free slot lock) and then its
    restart (a new instance id) are the proof (docs/failure-semantics.md). This ends the worker only:
    its stub sees the exit and starts a new one."""
    log.critical("prefill exits so that its restart proves no late KV write can land: %s", reason)
    os._exit(EXIT_FOR_PROOF)


def run(channel: Channel) -> int:
    """The worker's whole life on an open channel; returns the exit status."""
    first = channel.recv()
    if not isinstance(first, Init):
        log.error("tandem-engine: expected Init first, got %r", first)
        return 2
    t0 = time.monotonic()
    try:
        host = EngineHost(channel, first)
        ready = host.build()
    except Exception as exc:
        log.exception("%s: the engine could not start", first.instance)
        channel.send(Fail(0, "INTERNAL", f"{type(exc).__name__}: {exc}"))
        channel.close()
        return 1
    log.info(
        "%s: %s ready in %.1f s (pid %d)", first.instance, ready.detail, time.monotonic() - t0, ready.pid
    )
    channel.send(ready)
    return host.serve()
