"""`WS /v1/audio/speech/stream-input`: text in as it is produced (an LLM's tokens), audio out, turn
after turn and context beside context on one socket, for as long as a call lasts; docs/protocol.md,
"Streamed text input", is the contract.

Client frames (`gateway/ws_frames.py`), JSON text, each with a `type`: `config` first and once;
`text`, `flush`, `cancel`, `close_context`, each for a context (`context_id`; none: the default
one); `keepalive`; `close`. Server frames: `ready` after the config; the audio (binary frames, or
`audio` events with `config.audio` "json"); `turn_done`; `context_closed`; `error`.

The socket (`Connection`) reads frames and hands each to its context (`gateway/ws_context.py`:
turns, speaking); it owns what is shared: the config, the one speech session, the limits, the idle
clock. Activity is any client frame (`keepalive` included) or WebSocket ping (the protocol counts
them: `connection_guard.ClientPings`), or a turn ending; a socket inactive for its
`inactivity_timeout` (`config`, 1-600 s; before it, the gateway's `ws_idle_timeout_s`) while
nothing speaks gets an `UNAVAILABLE` error and a close frame, code `IDLE_CLOSE_CODE`. No HTTP
deadline applies to the upgraded connection (`gateway/serve.py`).

Limits: a turn holds at most `GatewaySettings.ws_max_pending_chars` unspoken characters (a `text`
past it is refused, param `text`, and dropped; the turn goes on); a socket holds at most `MAX_TURNS`
unfinished turns over its contexts (a frame that would open one more is refused, param `type`) and
`MAX_CONTEXTS` open contexts (a frame naming one more is refused, param `context_id`); a client that
does not read what is sent is cut by the HTTP server's write timeout. Every refusal is one `error`
frame on that socket only; the socket and its other frames go on. A client that leaves (or
`close`) cancels every stream of its socket.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, MutableMapping
from typing import Any, Protocol

from fastapi import FastAPI, WebSocket, WebSocketDisconnect

from tandem.gateway.connection_guard import PINGS_EXTENSION, ClientPings
from tandem.gateway.encode import CODECS
from tandem.gateway.errors import ClientCode
from tandem.gateway.session import SpeechSession
from tandem.gateway.stream import AudioPiece, GatewayError, SpeechModel
from tandem.gateway.tenants import ws_caller
from tandem.gateway.ws_context import Context, Voice
from tandem.gateway.ws_frames import (  # noqa: F401  (re-exported: the frames' limits)
    MAX_DEPTH,
    MAX_FRAME_CHARS,
    QUOTE_CHARS,
    CancelFrame,
    CloseContextFrame,
    CloseFrame,
    ConfigFrame,
    ContextFrame,
    FlushFrame,
    FrameError,
    KeepaliveFrame,
    TextFrame,
    parse_frame,
    quote,
)

log = logging.getLogger("tandem.gateway.ws")
PATH = "/v1/audio/speech/stream-input"
MAX_TURNS = 16  # unfinished turns per socket, over its contexts: each holds its text until it speaks
MAX_CONTEXTS = 5  # open contexts per socket, the default one included
IDLE_CLOSE_CODE = 1008  # policy violation: the socket outlived its inactivity_timeout
CLOSE_CODE = 1000  # the client's `close`


class Speaker(Protocol):
    """What the socket needs of the gateway (`app.Gateway`)."""

    @property
    def ws_limits(self) -> tuple[float, int]: ...  # idle timeout (s), a turn's unspoken characters

    def model(self, name: str) -> SpeechModel: ...

    def session(
        self, model: SpeechModel, voice: str, seed: int | None
    ) -> tuple[int, SpeechSession[AudioPiece]]: ...


class Connection:
    """One socket's state: its config, its contexts, its idle clock."""

    def __init__(self, ws: WebSocket, speaker: Speaker) -> None:
        self.ws = ws
        self.speaker = speaker
        self.idle_s, self.max_pending = speaker.ws_limits
        self.voice: Voice | None = None
        self.contexts: dict[str | None, tuple[Context, asyncio.Task[None]]] = {}
        self._send_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self.heard = self._loop.time()  # the last activity but pings (module docstring)
        extension = ws.scope.get("extensions", {}).get(PINGS_EXTENSION, {})
        self.pings: ClientPings = extension.get("pings") or ClientPings()

    # -- out ---------------------------------------------------------------------------------------
    async def send_json(self, event: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(event, separators=(",", ":")))

    async def send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.ws.send_bytes(data)

    def touch(self) -> None:
        self.heard = self._loop.time()

    async def error(self, code: ClientCode, message: str, param: str | None = None, **extra: Any) -> None:
        await self.send_json(
            {"type": "error", "code": code.value, "message": message, "param": param, **extra}
        )

    # -- in ----------------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while (msg := await self._receive()) is not None:
                self.touch()
                if msg["type"] == "websocket.disconnect":
                    return
                if msg.get("text") is None:
                    await self.error(
                        ClientCode.INVALID_ARG, "binary frames are not accepted: send JSON text frames"
                    )
                    continue
                if not await self._handle(msg["text"]):
                    await self.ws.close(CLOSE_CODE)
                    return
            idle = self.idle_s
            log.info("gateway: closed an idle WebSocket (no frame or ping for %g s)", idle)
            await self.error(ClientCode.UNAVAILABLE, f"no frame for {idle:g} s and nothing to speak: closing")
            await self.ws.close(IDLE_CLOSE_CODE, f"inactivity_timeout {idle:g} s")
        except WebSocketDisconnect:
            return
        finally:
            for ctx, task in list(self.contexts.values()):
                await ctx.stop(task)
            if self.voice is not None:
                self.voice.session.close()

    async def _receive(self) -> MutableMapping[str, Any] | None:
        """The next message, or None once the socket was inactive for `idle_s` with nothing speaking."""
        while True:
            left = max(self.heard, self.pings.last) + self.idle_s - self._loop.time()
            if left <= 0:
                if not self._busy():
                    return None
                self.touch()  # speaking: the client is listening
                continue
            # Not wait_for, which may swallow a cancel that meets a message (session.py says why).
            receiving = asyncio.ensure_future(self.ws.receive())
            try:
                done, _ = await asyncio.wait({receiving}, timeout=left)
            finally:
                if not receiving.done():
                    receiving.cancel()  # a message not taken stays queued for the next receive
            if done:
                return receiving.result()

    def _busy(self) -> bool:
        """A stream is open, or a flushed turn waits to speak."""
        speaking = self.voice is not None and self.voice.session.in_flight > 0
        return speaking or any(ctx.busy for ctx, _ in self.contexts.values())

    async def _handle(self, raw: str) -> bool:
        """One client frame; False: close the socket."""
        try:
            frame = parse_frame(raw)
        except FrameError as exc:
            await self.error(ClientCode.INVALID_ARG, str(exc), exc.param)
            return True
        if isinstance(frame, CloseFrame):
            return False
        if isinstance(frame, KeepaliveFrame):
            return True
        if isinstance(frame, ConfigFrame):
            await self._configure(frame)
            return True
        if self.voice is None:
            await self.error(
                ClientCode.INVALID_ARG, f"{frame.type} before config: send a config frame first", "type"
            )
            return True
        ctx = await self._context(frame)
        if ctx is None:
            return True
        if (
            isinstance(frame, (TextFrame, FlushFrame))
            and ctx.opens_turn()
            and self._unfinished() >= MAX_TURNS
        ):
            await self.error(
                ClientCode.INVALID_ARG,
                f"{self._unfinished()} turns are unfinished; the limit is {MAX_TURNS}: wait for turn_done",
                "type",
            )
            return True
        if isinstance(frame, TextFrame):
            if (refusal := await ctx.feed(frame.text, frame.speed)) is not None:
                await self.error(ClientCode.INVALID_ARG, *refusal)
        elif isinstance(frame, FlushFrame):
            await ctx.flush()
        elif isinstance(frame, CancelFrame):
            ctx.cancel()
        elif isinstance(frame, CloseContextFrame):
            ctx.close()
        return True

    def _unfinished(self) -> int:
        return sum(len(ctx.turns) for ctx, _ in self.contexts.values())

    async def _context(
        self, frame: TextFrame | FlushFrame | CancelFrame | CloseContextFrame
    ) -> Context | None:
        """The context `frame` names, opened by a text or flush; None (after its `error`) when the
        frame may not have it."""
        assert self.voice is not None
        cid = frame.context_id
        for key in [k for k, (_, task) in self.contexts.items() if task.done()]:  # closed ones
            del self.contexts[key]
        if cid is not None and self.voice.config.audio == "binary":
            await self.error(
                ClientCode.INVALID_ARG,
                'context_id needs config audio "json": binary frames cannot say which context they are',
                "context_id",
            )
            return None
        if (entry := self.contexts.get(cid)) is not None:
            if entry[0].closing:
                await self.error(
                    ClientCode.INVALID_ARG,
                    f"context {quote(cid)} is closing: wait for its context_closed",
                    "context_id",
                )
                return None
            return entry[0]
        if isinstance(frame, (CancelFrame, CloseContextFrame)):
            if cid is None:  # the default context has nothing to cancel yet
                return None
            await self.error(ClientCode.INVALID_ARG, f"no open context {quote(cid)}", "context_id")
            return None
        if len(self.contexts) >= MAX_CONTEXTS:
            await self.error(
                ClientCode.INVALID_ARG,
                f"{len(self.contexts)} contexts are open; the limit is {MAX_CONTEXTS}: close_context one",
                "context_id",
            )
            return None
        ctx = Context(cid, self.voice, self)
        self.contexts[cid] = (ctx, asyncio.create_task(ctx.run()))
        return ctx

    async def _configure(self, frame: ConfigFrame) -> None:
        if self.voice is not None:
            await self.error(ClientCode.INVALID_ARG, "config was sent already: one per socket", "type")
            return
        try:
            model = self.speaker.model(frame.model)
            _, session = self.speaker.session(model, frame.voice, frame.seed)
        except GatewayError as exc:
            await self.error(exc.error.code, str(exc.error), exc.param)
            return
        self.voice = Voice(frame, model.sample_rate, session, self.max_pending)
        if frame.inactivity_timeout is not None:
            self.idle_s = frame.inactivity_timeout
        rate = CODECS[frame.response_format].rate if frame.response_format in CODECS else None
        await self.send_json(
            {
                "type": "ready",
                "sample_rate": rate or model.sample_rate,
                "format": frame.response_format,
                "audio": frame.audio,
                "inactivity_timeout": self.idle_s,
            }
        )


def install(app: FastAPI, speaker_for: Callable[[str], Speaker]) -> None:
    """The route; `speaker_for(tenant)` is what a socket of that tenant speaks through."""

    @app.websocket(PATH)
    async def stream_input(ws: WebSocket) -> None:
        tenant = await ws_caller(ws)  # refused: answered 401 there (gateway/tenants.py)
        if tenant is None:
            return
        await ws.accept()
        await Connection(ws, speaker_for(tenant)).run()
