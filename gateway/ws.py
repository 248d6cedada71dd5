"""`WS /v1/audio/speech/stream-input`: text in as it is produced (an LLM's tokens), audio out, turn
after turn on one socket; docs/protocol.md, "Streamed text input", is the contract.

Client frames, JSON text, each with a `type`: `config` {model, voice, response_format (default
pcm), seed?} first and once; `text` {text}; `flush` (speak what is buffered, end the turn);
`cancel` (end every unfinished turn now: their streams are cancelled); `close`.
Server frames: `ready` {sample_rate, format} after the config; binary frames, the speaking turn's
audio in order (each turn one whole file of the format); `turn_done` {turn, cancelled, usage}; `error`
{code, message, param?} (a failed turn: its `error` with `turn`, then its `turn_done`).

A turn is the text between one flush and the next; its speech session (`gateway/session.py`) speaks
each complete sentence as soon as it is buffered and, after `flush`, the rest. Turns speak one after
another. Limits: a turn holds at most `GatewaySettings.ws_max_pending_chars` unspoken characters (a
`text` past it is refused with an `error`, param `text`, and dropped; the turn goes on); a socket
holds at most `MAX_TURNS` unfinished turns (a frame that would open one more is refused, param
`type`); a frame is at most `MAX_FRAME_CHARS` characters and `MAX_DEPTH` levels of JSON nesting,
both checked before it is parsed (the `error` names the limit and echoes no field: a value quoted in
an error is cut to `QUOTE_CHARS`); a socket that sends no frame for `ws_idle_timeout_s` while
nothing is speaking gets an `UNAVAILABLE` error and is closed; a client that does not read what is
sent is cut by the HTTP server's write timeout (`gateway/serve.py`). Every refusal is one `error`
frame on that socket only; the socket stays open. A client that leaves (or `close`) cancels every
stream of its socket. Segmentation of the text runs on `sentences.TEXT_EXECUTOR`, off the event
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from tandem.gateway.audio import AudioFormat, Framer, StreamFormat
from tandem.gateway.encode import CODECS
from tandem.gateway.errors import ClientCode
from tandem.gateway.sentences import TEXT_EXECUTOR, BufferFull, SentenceQueue
from tandem.gateway.session import SpeechSession
from tandem.gateway.stream import AudioPiece, GatewayError, SpeechModel
from tandem.gateway.tenants import ws_caller

log = logging.getLogger("tandem.gateway.ws")
PATH = "/v1/audio/speech/stream-input"
MAX_FRAME_CHARS = 64 * 1024  # a text frame carries at most ws_max_pending_chars (8,192), escaped
MAX_DEPTH = 2  # every frame is a flat object; one level of slack for a value a client wraps
MAX_TURNS = 16  # unfinished turns per socket: each holds its text until it speaks
QUOTE_CHARS = 40  # the most of a client's value an error quotes
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfigFrame(_Frame):
    type: Literal["config"]
    model: str
    voice: str
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] = "pcm"
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)


class TextFrame(_Frame):
    type: Literal["text"]
    text: str


class FlushFrame(_Frame):
    type: Literal["flush"]


class CancelFrame(_Frame):
    type: Literal["cancel"]


class CloseFrame(_Frame):
    type: Literal["close"]


ClientFrame = Annotated[
    ConfigFrame | TextFrame | FlushFrame | CancelFrame | CloseFrame, Field(discriminator="type")
]
_FRAME: TypeAdapter[Any] = TypeAdapter(ClientFrame)


class Speaker(Protocol):
    """What the socket needs of the gateway (`app.Gateway`)."""

    @property
    def ws_limits(self) -> tuple[float, int]: ...  # idle timeout (s), a turn's unspoken characters

    def model(self, name: str) -> SpeechModel: ...

    def session(
        self, model: SpeechModel, voice: str, seed: int | None
    ) -> tuple[int, SpeechSession[AudioPiece]]: ...


class FrameError(Exception):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _cut(text: str) -> str:
    """`text` as an error may quote it: at most `QUOTE_CHARS` characters of it."""
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text)} characters)"


def _quote(value: object) -> str:
    return _cut(repr(value))


def _depth(raw: str) -> int:
    """How deep `raw`'s arrays and objects nest (strings skipped); linear in its length."""
    depth = deepest = 0
    for bracket in _BRACKETS.findall(_STRINGS.sub("", raw)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_frame(raw: str) -> Any:
    """One client frame; raises FrameError naming what is wrong (`param`: the field). Size and
    nesting are checked before the JSON is parsed (a 100k-deep frame would end the parser in a
    RecursionError)."""
    if len(raw) > MAX_FRAME_CHARS:
        raise FrameError(f"frame is {len(raw)} characters; the limit is {MAX_FRAME_CHARS}", None)
    if (depth := _depth(raw)) > MAX_DEPTH:
        raise FrameError(f"frame nests {depth} levels of JSON; the limit is {MAX_DEPTH}", None)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise FrameError(f"frame is not JSON: {exc}", None) from None
    if not isinstance(data, dict):
        raise FrameError(f"frame is a JSON {type(data).__name__}, not an object with a type", None)
    if "type" not in data:
        raise FrameError("frame has no type (one of config, text, flush, cancel, close)", "type")
    try:
        return _FRAME.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        if loc and loc[0] == data.get("type"):  # the union's tag leads the location
            loc = loc[1:]
        if first.get("type") == "union_tag_invalid":
            return _raise(
                f"type {_quote(data['type'])} is not one of config, text, flush, cancel, close", "type"
            )
        param = loc[0] if loc else None
        kind, where = _cut(str(data.get("type"))), _cut(".".join(loc) or "frame")
        return _raise(f"{kind} frame: {where}: {first.get('msg')}", param and _cut(param))


def _raise(message: str, param: str | None) -> Any:
    raise FrameError(message, param)


@dataclass
class Turn:
    index: int
    text: SentenceQueue
    more: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    cancelled: bool = False
    rows: int = 0
    segments: int = 0


class Connection:
    """One socket's state: its config, its turns (the first unfinished one speaking)."""

    def __init__(self, ws: WebSocket, speaker: Speaker) -> None:
        self.ws = ws
        self.speaker = speaker
        self.idle_s, self.max_pending = speaker.ws_limits
        self.config: ConfigFrame | None = None
        self.model: SpeechModel | None = None
        self.session: SpeechSession[AudioPiece] | None = None
        self.turns: deque[Turn] = deque()  # unfinished, in order
        self.open: Turn | None = None  # the turn text goes to (not flushed yet)
        self.queued: asyncio.Queue[Turn] = asyncio.Queue()
        self.next_turn = 0
        self._send_lock = asyncio.Lock()
        self._speaker: asyncio.Task[None] | None = None

    async def send_json(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(event, separators=(",", ":")))

    async def send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.ws.send_bytes(data)

    async def error(self, code: ClientCode, message: str, param: str | None = None, **extra: Any) -> None:
        await self.send_json(
            {"type": "error", "code": code.value, "message": message, "param": param, **extra}
        )

    async def run(self) -> None:
        self._speaker = asyncio.create_task(self._speak_turns())
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(self.ws.receive(), self.idle_s)
                except asyncio.TimeoutError:
                    if self._busy():
                        continue  # speaking: the client is listening
                    await self.error(
                        ClientCode.UNAVAILABLE,
                        f"no frame for {self.idle_s:g} s and nothing to speak: closing",
                    )
                    await self.ws.close(1000)
                    return
                if msg["type"] == "websocket.disconnect":
                    return
                if msg.get("text") is None:
                    await self.error(
                        ClientCode.INVALID_ARG, "binary frames are not accepted: send JSON text frames"
                    )
                    continue
                if not await self._handle(msg["text"]):
                    await self.ws.close(1000)
                    return
        except WebSocketDisconnect:
            return
        finally:
            self.cancel_all()
            self._speaker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._speaker
            for t in list(self.turns):
                if t.task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await t.task
            if self.session is not None:
                self.session.close()

    def _busy(self) -> bool:
        """A stream is open, or a flushed turn waits to speak."""
        speaking = self.session is not None and self.session.in_flight > 0
        return speaking or any(t.text.flushed and not t.cancelled for t in self.turns)

    async def _handle(self, raw: str) -> bool:
        """One client frame; False: close the socket."""
        try:
            frame = parse_frame(raw)
        except FrameError as exc:
            await self.error(ClientCode.INVALID_ARG, str(exc), exc.param)
            return True
        if isinstance(frame, CloseFrame):
            return False
        if isinstance(frame, ConfigFrame):
            await self._configure(frame)
            return True
        if self.config is None:
            await self.error(
                ClientCode.INVALID_ARG, f"{frame.type} before config: send a config frame first", "type"
            )
            return True
        if isinstance(frame, (TextFrame, FlushFrame)) and self.open is None and len(self.turns) >= MAX_TURNS:
            await self.error(
                ClientCode.INVALID_ARG,
                f"{len(self.turns)} turns are unfinished; the limit is {MAX_TURNS}: wait for turn_done",
                "type",
            )
            return True
        loop = asyncio.get_running_loop()
        if isinstance(frame, TextFrame):
            turn = self._open_turn()
            try:
                await loop.run_in_executor(TEXT_EXECUTOR, turn.text.feed, frame.text)
            except BufferFull as exc:
                await self.error(
                    ClientCode.INVALID_ARG, f"text refused: {exc}; flush and wait for turn_done", "text"
                )
            turn.more.set()
        elif isinstance(frame, FlushFrame):
            turn = self._open_turn()
            await loop.run_in_executor(TEXT_EXECUTOR, turn.text.flush)
            turn.more.set()
            self.open = None
        elif isinstance(frame, CancelFrame):
            self.cancel_all()
        return True

    async def _configure(self, frame: ConfigFrame) -> None:
        if self.config is not None:
            await self.error(ClientCode.INVALID_ARG, "config was sent already: one per socket", "type")
            return
        try:
            model = self.speaker.model(frame.model)
            _, self.session = self.speaker.session(model, frame.voice, frame.seed)
        except GatewayError as exc:
            await self.error(exc.error.code, str(exc.error), exc.param)
            return
        self.config, self.model = frame, model
        rate = CODECS[frame.response_format].rate if frame.response_format in CODECS else None
        await self.send_json(
            {"type": "ready", "sample_rate": rate or model.sample_rate, "format": frame.response_format}
        )

    def _open_turn(self) -> Turn:
        if self.open is None:
            self.open = Turn(self.next_turn, SentenceQueue(max_pending_chars=self.max_pending))
            self.next_turn += 1
            self.turns.append(self.open)
            self.queued.put_nowait(self.open)
        return self.open

    def cancel_all(self) -> None:
        """Every unfinished turn ends now (its streams are cancelled); later text opens a new turn."""
        for t in self.turns:
            t.cancelled = True
            t.more.set()
            if t.task is not None:
                t.task.cancel()
        self.open = None

    async def _speak_turns(self) -> None:
        while True:
            turn = await self.queued.get()
            if not turn.cancelled:
                turn.task = asyncio.create_task(self._speak(turn))
                await asyncio.wait([turn.task])
            self.turns.remove(turn)
            usage = {"output_tokens": turn.rows, "segments": turn.segments}
            with contextlib.suppress(Exception):  # the client may be gone
                await self.send_json(
                    {"type": "turn_done", "turn": turn.index, "cancelled": turn.cancelled, "usage": usage}
                )

    async def _speak(self, turn: Turn) -> None:
        assert self.session is not None and self.config is not None and self.model is not None
        framer = Framer(AudioFormat(self.config.response_format), StreamFormat.AUDIO, self.model.sample_rate)
        started = self.session.started
        try:
            async for piece in self.session.speak(turn.text, turn.more):
                turn.rows += piece.rows
                turn.segments = self.session.started - started
                if data := framer.piece(piece.pcm):
                    await self.send_bytes(data)
            if data := framer.end(turn.rows):
                await self.send_bytes(data)
        except GatewayError as exc:
            turn.cancelled = True
            log.info("gateway: WebSocket turn %d failed: %s", turn.index, exc.error)
            with contextlib.suppress(Exception):
                await self.error(exc.error.code, str(exc.error), exc.param, turn=turn.index)
        except Exception as exc:  # the socket broke under a send: the receive side ends the connection
            turn.cancelled = True
            log.debug("gateway: WebSocket turn %d ended: %r", turn.index, exc)
        finally:
            turn.segments = self.session.started - started


def install(app: FastAPI, speaker_for: Callable[[str], Speaker]) -> None:
    """The route; `speaker_for(tenant)` is what a socket of that tenant speaks through."""

    @app.websocket(PATH)
    async def stream_input(ws: WebSocket) -> None:
        tenant = await ws_caller(ws)  # refused: answered 401 there (gateway/tenants.py)
        if tenant is None:
            return
        await ws.accept()
        await Connection(ws, speaker_for(tenant)).run()
