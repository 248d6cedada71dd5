"""tandem-gateway: the unit's HTTP front door, OpenAI's speech API over Triton gRPC streaming.

Routes (FastAPI on uvicorn; `cli/gateway.py` starts it):

- `POST /v1/audio/speech`: OpenAI's body (`model`, `input` up to 4,096 characters, `voice`,
  `response_format` mp3 (the default, as OpenAI's), opus, aac, flac, wav or pcm, `speed` 0.25-4.0,
  `stream_format` `audio` or `sse`, `instructions` refused: no served family follows them) and
  tandem's `seed` (every segment's SEED). The input is spoken whole by a speech session
  (`gateway/session.py`: sentence segments, one stream each, two in flight, audio in order); the
  audio is streamed as the model produces it: the status and headers wait for the first audio (or
  the error that comes instead, with its own status), then each response's audio goes out at once.
  A `wav` asked for without `stream_format` is the exception: it is answered whole, its header with
  the real length (what the OpenAI SDK's non-streaming `create` and Python's `wave` expect).
  `X-Tandem-Stream-Id` is the first segment's stream id (Triton `sequence_id`; the next segments'
  follow it, +1 each, but for a segment tried again); `X-Sample-Rate` the PCM rate. A caller who
  hangs up cancels every stream of the session (the gRPC calls are cancelled; Triton tells the
  engines). Once the first audio is out the response is the session's: a later segment the unit
  sheds is tried again (`SpeechSession`), and a segment that still fails aborts the response — a
  chunked body ends without its last chunk, an SSE stream with an `error` event — so no cut body
  reads as complete.
- `WS /v1/audio/speech/stream-input`: text in pieces, audio out, turn by turn (`gateway/ws.py`).
- `GET /v1/models`, `GET /v1/models/{id}`: the served models, OpenAI's list format.
- `GET /health`: speech: 200 when Triton calls the served speech models ready and the unit is ready
  by `serving.health` (every speech `tandem_engine_up` 1, no speech stub silent, no `tandem_draining`
  1), else 503 with the reasons; `voices` never counts. `GET /health?model=voices`: registration's
  own readiness (the voices model and its engine), the same way.
- `GET /metrics`: the gateway's own metrics (`gateway/metrics.py`).
- `POST /v1/voices`, `GET /v1/voices`, `DELETE /v1/voices/{name}`: registered voices
  (`gateway/voices.py`).

Errors are OpenAI's JSON, `{"error": {"message", "type", "param", "code"}}`, with `code` the tandem
code (`gateway/errors.py`) and the HTTP status by it: 400 INVALID_ARG, 404 NOT_FOUND (unknown
model), 503 UNAVAILABLE (over capacity, Triton not ready), 500 INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import tritonclient.grpc.aio as aio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from tandem.gateway.aliases import Aliases
from tandem.gateway.audio import MEDIA_TYPES, AudioFormat, Framer, StreamFormat, wav_header
from tandem.gateway.encode import SPEED_MAX, SPEED_MIN
from tandem.gateway.errors import HTTP_STATUS, ClientCode, ClientError
from tandem.gateway.http_errors import error_body
from tandem.gateway.http_errors import install as install_http_errors
from tandem.gateway.limits import SPEECH_BODY_BYTES, ContentLengthLimit, Utf8Str, route_limit
from tandem.gateway.metrics import NO_MODEL, GatewayMetrics
from tandem.gateway.sentences import TEXT_EXECUTOR, SentenceQueue
from tandem.gateway.session import SpeechSession
from tandem.gateway.stream import (
    DECODE,
    LOST_POLL_S,
    AudioPiece,
    GatewayError,
    LostCheck,
    SpeechModel,
    StreamRequest,
    cancel_on_decode,
    discover,
    new_stream_id,
    refuse,
    stream_audio,
    text_inputs,
)
from tandem.gateway.tenants import OPEN, ApiKeys, Tenant, Unauthorized, voice_id
from tandem.gateway.voice_client import MODEL as VOICES_MODEL
from tandem.gateway.voice_users import VoiceUsers
from tandem.gateway.voices import install as install_voice_routes
from tandem.gateway.ws import install as install_ws_route
from tandem.serving.health import HealthUnavailable, UnitHealth, fetch_health

log = logging.getLogger("tandem.gateway")

# Triton may still be starting or be restarted by tandem-unit: reconnect within ~2 s, not after gRPC's
# default backoff (up to 120 s, during which every call fails at once); no message size limit.
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class GatewaySettings:
    triton_url: str  # HOST:GRPC_PORT
    metrics_url: str  # Triton's metrics endpoint, for /health
    models: tuple[str, ...] = ("tts", "tts_mono")
    idle_timeout_s: float = 60.0  # no response from Triton for this long ends a stream (UNAVAILABLE)
    # A stream silent this long while the unit reports a dead stub on its path is lost (UNAVAILABLE).
    lost_after_s: float = 5.0
    retry_s: float = 1.0  # how often start-up asks Triton for the models' configs until it answers
    ws_idle_timeout_s: float = 60.0  # a WebSocket's default inactivity_timeout (gateway/ws.py)
    ws_max_pending_chars: int = 8192  # a WebSocket turn's unspoken text at most (gateway/ws.py)
    aliases: Aliases = field(default_factory=Aliases)  # OpenAI's model and voice names (gateway/aliases.py)
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys({}))  # none: open mode (gateway/tenants.py)


class VoiceRef(BaseModel):
    id: Utf8Str


class SpeechBody(BaseModel):
    """OpenAI's `POST /v1/audio/speech` body; unknown fields are refused, as OpenAI does."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: Utf8Str = Field(max_length=4096)
    voice: Utf8Str | VoiceRef
    instructions: Utf8Str | None = None
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "mp3"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # tandem's: every segment's SEED

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


def error_response(err: ClientError, param: str | None = None) -> JSONResponse:
    status = HTTP_STATUS[err.code]
    return JSONResponse(error_body(status, str(err), param, err.code.value), status_code=status)


class Gateway:
    """The app's state: one aio client to Triton, the models read at start-up, the metrics."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics()
        for name in settings.models:
            self.metrics.serve(name)
        self.client: aio.InferenceServerClient | None = None
        self.models: dict[str, SpeechModel] | None = None  # None until Triton answered
        self._discovery: asyncio.Task[None] | None = None
        self._health: tuple[float, UnitHealth | None] = (-1.0, None)  # (when read, what it said)
        self._health_lock = asyncio.Lock()
        self._cancels: set[asyncio.Task[None]] = set()  # CANCELs to D in flight (kept from the GC)
        self.voice_users = VoiceUsers()  # a voice's deletion waits for the sessions speaking with it

    async def start(self) -> None:
        self.client = aio.InferenceServerClient(self.settings.triton_url, channel_args=CHANNEL_ARGS)
        self._discovery = asyncio.create_task(self._discover())

    async def _discover(self) -> None:
        assert self.client is not None
        waiting = False
        while self.models is None:
            try:
                self.models = await discover(self.client, self.settings.models)
                log.info("gateway: serving %s from %s", ", ".join(self.models), self.settings.triton_url)
            except Exception as exc:  # Triton still starting: ask again (said once, not every second)
                if not waiting:
                    log.info("gateway: waiting for Triton at %s (%s)", self.settings.triton_url, exc)
                waiting = True
                await asyncio.sleep(self.settings.retry_s)

    async def stop(self) -> None:
        if self._cancels:  # CANCELs to D still on their way: give them their bound
            await asyncio.wait(set(self._cancels), timeout=5.0)
        if self._discovery is not None:
            self._discovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._discovery
        if self.client is not None:
            await self.client.close()

    def model(self, name: str) -> SpeechModel:
        if self.models is None:
            raise refuse(ClientCode.UNAVAILABLE, f"Triton at {self.settings.triton_url} is not ready yet")
        name = self.settings.aliases.model(name, tuple(self.models))
        if name not in self.models:
            raise refuse(
                ClientCode.NOT_FOUND,
                f"model {name!r} is not served here (served: {', '.join(self.models)})",
                "model",
            )
        return self.models[name]

    async def _unit_health(self) -> UnitHealth | None:
        """The unit's health by its metrics, read at most once a second however many streams ask;
        None when the metrics cannot be read (then nothing is judged lost: the idle timeout holds)."""
        async with self._health_lock:
            read_at, health = self._health
            if time.monotonic() - read_at >= LOST_POLL_S:
                try:
                    health = await asyncio.to_thread(fetch_health, self.settings.metrics_url, 2.0, True)
                except HealthUnavailable:
                    health = None
                except Exception:  # metrics that do not parse: judge nothing lost (the idle timeout holds)
                    log.warning("gateway: the unit's metrics could not be read as health", exc_info=True)
                    health = None
                self._health = (time.monotonic(), health)
            return health

    def lost_check(self, path: frozenset[str]) -> LostCheck:
        """Whether a silent stream through the models of `path` is lost: a stub of one of them is
        silent (dead or stopped: Triton never answers what it held)."""

        async def lost() -> str | None:
            health = await self._unit_health()
            dead = [
                f"{m} {i} is dead (its stub silent for {s:.1f} s)"
                for m, i, s in (health.silent_stubs if health is not None else ())
                if m in path
            ]
            return "; ".join(dead) or None

        return lost

    def stream(self, req: StreamRequest) -> AsyncGenerator[AudioPiece, None]:
        """`req`'s audio (`stream_audio`) with this gateway's bounds."""
        assert self.client is not None
        s, known = self.settings, (self.models or {}).get(req.model)
        path = known.path if known is not None else frozenset({req.model})
        # An ensemble with a decode step: an abandoned stream's cancellation does not reach D by itself.
        abandoned = self._cancel_on_decode if DECODE in path and req.model != DECODE else None
        return stream_audio(
            self.client, req, s.idle_timeout_s, self.lost_check(path), s.lost_after_s, abandoned
        )

    def _cancel_on_decode(self, stream_id: int) -> None:
        """Tell D to drop `stream_id`, in the background (the caller is already gone)."""
        assert self.client is not None
        client = self.client

        async def cancel() -> None:
            try:
                await cancel_on_decode(client, stream_id)
            except GatewayError as exc:
                log.warning("gateway: stream %d: could not cancel it on decode: %s", stream_id, exc.error)
            except Exception:  # the channel closed (the gateway stops)
                log.warning("gateway: stream %d: could not cancel it on decode", stream_id, exc_info=True)

        task = asyncio.get_running_loop().create_task(cancel())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    @property
    def ws_limits(self) -> tuple[float, int]:
        return self.settings.ws_idle_timeout_s, self.settings.ws_max_pending_chars

    def voice(self, model: SpeechModel, voice: str, tenant: str) -> str:
        """The voice the unit speaks for `tenant`'s `voice` on `model`: an alias's target
        (`gateway/aliases.py`), a built-in voice as it is, a registered one in the tenant's
        namespace (`gateway/tenants.py`)."""
        voice = self.settings.aliases.voice(voice, model.voices)
        if not voice or voice in model.voices:
            return voice
        if "." in voice:  # the namespace separator: a caller names only its own voices
            raise refuse(ClientCode.INVALID_ARG, f"voice {voice!r} is not a voice name (no '.')", "voice")
        return voice_id(tenant, voice)

    def for_tenant(self, tenant: str) -> TenantSpeaker:
        """What a WebSocket of `tenant` speaks through (`gateway/ws.py`'s Speaker)."""
        return TenantSpeaker(self, tenant)

    def session(
        self, model: SpeechModel, voice: str, seed: int | None, tenant: str = OPEN
    ) -> tuple[int, SpeechSession[AudioPiece]]:
        """A speech session speaking with `tenant`'s `voice` and `seed` on `model`; its first stream id (the
        next segments' ids follow it; a segment tried again after a shed gets a fresh one). The
        caller closes the session (`SpeechSession.close`) when it is over: until then a deletion of
        its voice waits (`gateway/voice_users.py`)."""
        voice = self.voice(model, voice, tenant)
        base = (new_stream_id() >> 1) + 1  # non-zero, with room for a session's consecutive ids below 2**63
        opened: set[int] = set()

        def open_segment(text: str, index: int) -> AsyncGenerator[AudioPiece, None]:
            stream_id = base + index if index not in opened else (new_stream_id() >> 1) + 1
            opened.add(index)
            req = StreamRequest(model.name, text_inputs(model, text, voice, seed), stream_id)
            return self.stream(req)

        release = self.voice_users.hold(voice)
        session = SpeechSession(open_segment, retryable=_shed, on_close=release)
        return base, session

    def label(self, model: str) -> str:
        """`model` as the metrics' label: a name this gateway serves (an alias counts as its model),
        else NO_MODEL."""
        model = self.settings.aliases.model(model, self.settings.models)
        return model if model in self.settings.models else NO_MODEL

    async def speech(self, body: SpeechBody, request: Request | None = None, tenant: str = OPEN) -> Response:
        received = time.monotonic()
        model = self.model(body.model)
        check_speech(body.speed, body.instructions)
        text = SentenceQueue()
        # Segmentation is CPU work: off the event loop (gateway/sentences.py).
        await asyncio.get_running_loop().run_in_executor(TEXT_EXECUTOR, _whole, text, body.input)
        if text.done:
            raise refuse(ClientCode.INVALID_ARG, "input is empty", "input")
        first_id, session = self.session(model, body.voice_name, body.seed, tenant)
        pieces = _spoken(session, text)
        if body.response_format in WHOLE and "stream_format" not in body.model_fields_set:
            fmt = AudioFormat(body.response_format)
            return await self.respond_whole(pieces, model, fmt, body.speed, received, first_id, request)
        framer = Framer(
            AudioFormat(body.response_format),
            StreamFormat(body.stream_format),
            model.sample_rate,
            speed=body.speed,
        )
        return await self.respond_pieces(pieces, framer, received, first_id, model.name)

    async def respond(self, req: StreamRequest, framer: Framer, received: float) -> Response:
        """One stream's response (`respond_pieces`)."""
        pieces = self.stream(req)
        return await self.respond_pieces(pieces, framer, received, req.stream_id, self.label(req.model))

    async def respond_whole(
        self,
        pieces: AsyncGenerator[AudioPiece, None],
        model: SpeechModel,
        fmt: AudioFormat,
        speed: float,
        received: float,
        stream_id: int,
        request: Request | None = None,
    ) -> Response:
        """A `wav` or `flac` asked for without `stream_format`: the whole file in one body, its
        header with the real length (WAV's sizes; FLAC's STREAMINFO total samples) and a
        Content-Length (the OpenAI SDK's `speech.create(...).write_to_file` and Python's `wave` read
        it exactly); an error at any point is a JSON error with its status. `stream_format: "audio"`
        streams the file instead, its length unknown. A caller who hangs up meanwhile (`request`
        disconnected, checked at each piece) ends the session."""
        wav = fmt is AudioFormat.WAV
        pcm = Framer(
            AudioFormat.PCM if wav else fmt, StreamFormat.AUDIO, model.sample_rate, speed=speed, whole=True
        )
        data: list[bytes] = []
        rows, first = 0, True
        self.metrics.streams.labels(model=model.name).inc()
        try:
            async for piece in pieces:
                if first:
                    self.metrics.first_audio.labels(model=model.name).observe(time.monotonic() - received)
                    first = False
                rows += piece.rows
                data.append(pcm.piece(piece.pcm))
                if request is not None and await request.is_disconnected():
                    self.metrics.count(499, model.name)
                    return Response(status_code=499)  # nobody reads it; the streams end below
            data.append(pcm.end(rows))
        finally:
            self.metrics.streams.labels(model=model.name).dec()
            await pieces.aclose()
        body = b"".join(data)
        self.metrics.count(200, model.name)
        headers = {"X-Tandem-Stream-Id": str(stream_id), "X-Sample-Rate": str(pcm.output_rate)}
        if wav:
            body = wav_header(model.sample_rate, len(body)) + body
        return Response(body, media_type=MEDIA_TYPES[fmt], headers=headers)

    async def respond_pieces(
        self,
        pieces: AsyncGenerator[AudioPiece, None],
        framer: Framer,
        received: float,
        stream_id: int,
        model: str,
    ) -> Response:
        """Waits for the first audio (an error before it is a JSON error with its status), then streams."""
        try:
            first: AudioPiece | None = await anext(pieces)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await pieces.aclose()
            raise
        self.metrics.first_audio.labels(model=model).observe(time.monotonic() - received)
        headers = {"X-Tandem-Stream-Id": str(stream_id), "X-Sample-Rate": str(framer.output_rate)}
        return StreamingResponse(
            self._body(first, pieces, framer, model), media_type=framer.media_type, headers=headers
        )

    async def _body(
        self, first: AudioPiece | None, pieces: AsyncGenerator[AudioPiece, None], framer: Framer, model: str
    ) -> AsyncIterator[bytes]:
        status, rows, prompt_rows = "499", 0, 0  # unless the stream ends one way or the other below
        self.metrics.streams.labels(model=model).inc()
        try:
            if first is not None:
                rows, prompt_rows = rows + first.rows, prompt_rows + first.prompt_rows
                if data := framer.piece(first.pcm):
                    yield data
                async for piece in pieces:
                    rows, prompt_rows = rows + piece.rows, prompt_rows + piece.prompt_rows
                    if data := framer.piece(piece.pcm):
                        yield data
            if data := framer.end(rows, prompt_rows):
                yield data
            status = "200"
        except GatewayError as exc:
            status = str(HTTP_STATUS[exc.error.code])
            log.warning("gateway: stream failed after its first audio: %s", exc.error)
            tail = framer.error(exc.error)
            if tail is None:
                raise  # the status is sent: end the body without its last chunk
            yield tail
        finally:
            self.metrics.streams.labels(model=model).dec()
            self.metrics.count(int(status), model)
            await pieces.aclose()

    async def health(self, voices: bool = False) -> JSONResponse:
        """Speech (default): the served speech models READY in Triton and every engine and stub they
        need up by the unit's metrics; `voices`: registration alone (the voices model and its engine),
        a failure domain of its own that never makes speech unready (docs/failure-semantics.md)."""
        assert self.client is not None
        reasons: list[str] = []
        names = (VOICES_MODEL,) if voices else self.settings.models
        try:
            for name in names:
                if not await self.client.is_model_ready(name):
                    reasons.append(f"model {name!r} is not ready in Triton")
        except Exception as exc:
            reasons.append(f"Triton at {self.settings.triton_url} does not answer: {exc}")
        if not reasons:
            try:
                unit = await asyncio.to_thread(fetch_health, self.settings.metrics_url)
                reasons += unit.voices_reasons if voices else unit.reasons
            except HealthUnavailable as exc:
                reasons.append(str(exc))
        if self.models is None and not voices:
            reasons.append("the served models' configs are not read yet")
        ok = not reasons
        return JSONResponse({"status": "ok" if ok else "unavailable", "reasons": reasons}, 200 if ok else 503)


@dataclass(frozen=True)
class TenantSpeaker:
    """The gateway as one tenant's WebSocket sees it: its sessions speak the tenant's voices."""

    gateway: Gateway
    tenant: str

    @property
    def ws_limits(self) -> tuple[float, int]:
        return self.gateway.ws_limits

    def model(self, name: str) -> SpeechModel:
        return self.gateway.model(name)

    def session(
        self, model: SpeechModel, voice: str, seed: int | None
    ) -> tuple[int, SpeechSession[AudioPiece]]:
        return self.gateway.session(model, voice, seed, self.tenant)


WHOLE = ("wav", "flac")  # answered whole, with their length, unless a stream_format is asked for


def _whole(text: SentenceQueue, whole: str) -> None:
    text.feed(whole)
    text.flush()


def _shed(exc: Exception) -> bool:
    """A segment's error that trying it again may cure: the unit had no room for it (UNAVAILABLE)."""
    return isinstance(exc, GatewayError) and exc.error.code is ClientCode.UNAVAILABLE


async def _spoken(
    session: SpeechSession[AudioPiece], text: SentenceQueue
) -> AsyncGenerator[AudioPiece, None]:
    """`session.speak(text)`, the session closed when it ends however it ends."""
    pieces = session.speak(text)
    try:
        async for piece in pieces:
            yield piece
    finally:
        await pieces.aclose()
        session.close()


def check_speech(speed: float, instructions: str | None) -> None:
    """`speed` in [0.25, 4.0]; `instructions` none: the served families (plain, Orpheus) speak the
    text as written and follow no style instructions, so they are refused rather than dropped."""
    if not SPEED_MIN <= speed <= SPEED_MAX:
        raise refuse(
            ClientCode.INVALID_ARG, f"speed = {speed:g}: outside [{SPEED_MIN:g}, {SPEED_MAX:g}]", "speed"
        )
    if instructions and instructions.strip():
        raise refuse(
            ClientCode.INVALID_ARG,
            "instructions are not supported: the served models speak the input as written and follow no "
            "style instructions (leave instructions out)",
            "instructions",
        )


def create_app(settings: GatewaySettings) -> FastAPI:
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.api_keys.open:
            log.warning(
                "gateway: open development mode: no API keys (--api-keys), every caller is served "
                "without one and shares one set of registered voices"
            )
        else:
            tenants = len(set(settings.api_keys.tenants.values()))
            log.info("gateway: %d API keys of %d tenants", len(settings.api_keys.tenants), tenants)
        await gw.start()
        try:
            yield
        finally:
            await gw.stop()

    app = FastAPI(title="tandem-gateway", lifespan=lifespan)
    app.state.gateway = gw
    app.state.api_keys = settings.api_keys
    count = gw.metrics.count
    install_http_errors(app, count)  # 404, 405, 413, unparsable bodies, 500: OpenAI's JSON
    # A Content-Length over the route's max_body_size (SPEECH_BODY_BYTES where a route has none) is
    # refused before the app runs; a chunked body is cut at it by FastAPI (gateway/limits.py).
    app.add_middleware(
        ContentLengthLimit, limit_of=route_limit(app.router.routes, SPEECH_BODY_BYTES), count=count
    )

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> JSONResponse:
        count(HTTP_STATUS[exc.error.code], getattr(request.state, "model", NO_MODEL))
        return error_response(exc.error, exc.param)

    @app.exception_handler(Unauthorized)
    async def _unauthorized(_: Request, exc: Unauthorized) -> JSONResponse:
        count(401)
        body = error_body(401, str(exc), None, "invalid_api_key")
        return JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # A check of our own (e.g. Utf8Str) says more than the other branches of a union.
        first: dict[str, Any] = next(
            (e for e in errors if e.get("type") == "value_error"), errors[0] if errors else {}
        )
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p)]
        if first.get("type") == "json_invalid":  # loc is the body and the offset
            loc = []
        param = loc[0] if loc else None
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        detail = f"{'.'.join(loc) or 'body'}: {msg}"
        count(400)
        return error_response(ClientError(ClientCode.INVALID_ARG, detail), param)

    install_voice_routes(app)  # POST/GET/DELETE /v1/voices (gateway/voices.py)
    install_ws_route(app, gw.for_tenant)  # WS /v1/audio/speech/stream-input (gateway/ws.py)

    @app.post("/v1/audio/speech", max_body_size=SPEECH_BODY_BYTES)
    async def speech(body: SpeechBody, request: Request, tenant: Tenant) -> Response:
        request.state.model = gw.label(body.model)  # for the metrics of a refusal (_gateway_error)
        return await gw.speech(body, request, tenant)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = list(gw.models or {})
        return {"object": "list", "data": [_model_card(n) for n in names]}

    @app.get("/v1/models/{name}")
    async def model(name: str) -> dict[str, Any]:
        return _model_card(gw.model(name).name)

    @app.get("/health")
    async def health(model: str | None = None) -> JSONResponse:
        """`/health`: speech; `/health?model=voices`: voice registration (its own readiness)."""
        if model not in (None, "", VOICES_MODEL):
            wrong = ClientError(ClientCode.INVALID_ARG, "model: leave it out (speech), or voices")
            return error_response(wrong, "model")
        return await gw.health(voices=model == VOICES_MODEL)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "tandem"}
