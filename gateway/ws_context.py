"""One context of a stream-input WebSocket: its own sequence of turns, spoken one after another by
its own task, cancelled or closed on its own (docs/protocol.md, "Streamed text input").

A turn is the text between one flush and the next in its context; the socket's one speech session
(`gateway/session.py`) speaks it: each complete sentence as soon as it is buffered, or after
`SENTENCE_QUIET_S` without new text when the segmenter holds the last one complete, and after
`flush` the rest. Every context shares that session's two stream slots, so a socket holds at most
two streams on the unit whatever its contexts do.

Lifecycle: `Connection` (`gateway/ws.py`) builds a context on the first frame that names it and
starts `run`; `feed`/`flush` open turns (each queued to `run`), `cancel` ends every unfinished turn
of the context now (their streams cancelled, each still answered by its `turn_done`), `close`
cancels the same and ends `run` after the last `turn_done`, with `context_closed`. Nothing here
reads the socket: the connection hands frames in, and `Outbox` carries what goes out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.gateway.audio import AudioFormat, Framer, StreamFormat
from tandem.gateway.sentences import TEXT_EXECUTOR, BufferFull, SentenceQueue
from tandem.gateway.session import SpeechSession
from tandem.gateway.stream import AudioPiece, GatewayError
from tandem.gateway.ws_frames import ConfigFrame

log = logging.getLogger("tandem.gateway.ws")
SENTENCE_QUIET_S = 0.2  # no new text this long: a complete last sentence speaks without a flush


class Outbox(Protocol):
    """What a context sends through its socket (`gateway/ws.py`'s `Connection`)."""

    async def send_json(self, event: dict[str, Any]) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    def touch(self) -> None: ...  # the socket was active now (a turn ended): its idle clock restarts


@dataclass
class Turn:
    index: int
    text: SentenceQueue
    speed: float
    more: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    cancelled: bool = False
    rows: int = 0
    segments: int = 0


@dataclass(frozen=True)
class Voice:
    """What every turn of a socket speaks with (its `config`)."""

    config: ConfigFrame
    sample_rate: int  # the model's
    session: SpeechSession[AudioPiece]
    max_pending_chars: int


class Context:
    def __init__(self, context_id: str | None, voice: Voice, out: Outbox) -> None:
        self.id = context_id  # None: the default context (frames about it carry no context_id)
        self.voice = voice
        self.out = out
        self.turns: deque[Turn] = deque()  # unfinished, in order
        self.open: Turn | None = None  # the turn text goes to (not flushed yet)
        self.queued: asyncio.Queue[Turn | None] = asyncio.Queue()  # None: closed, end `run`
        self.closing = False
        self.next_turn = 0

    @property
    def busy(self) -> bool:
        """A flushed turn waits or speaks."""
        return any(t.text.flushed and not t.cancelled for t in self.turns)

    def _tagged(self, event: dict[str, Any]) -> dict[str, Any]:
        return event if self.id is None else {**event, "context_id": self.id}

    # -- frames in (the connection's receive loop) ------------------------------------------------
    def opens_turn(self) -> bool:
        """A text or flush now would open a turn."""
        return self.open is None

    async def feed(self, text: str, speed: float | None) -> tuple[str, str] | None:
        """Text for the open turn (opened at `speed` if none is); when refused, (message, param)."""
        if self.open is not None and speed is not None and speed != self.open.speed:
            why = f"speed {speed:g} for a turn opened at {self.open.speed:g}: a turn's first text sets it"
            return why, "speed"
        turn = self._open_turn(speed)
        try:
            await asyncio.get_running_loop().run_in_executor(TEXT_EXECUTOR, turn.text.feed, text)
        except BufferFull as exc:
            return f"text refused: {exc}; flush and wait for turn_done", "text"
        finally:
            turn.more.set()
        return None

    async def flush(self) -> None:
        turn = self._open_turn(None)
        await asyncio.get_running_loop().run_in_executor(TEXT_EXECUTOR, turn.text.flush)
        turn.more.set()
        self.open = None

    def cancel(self) -> None:
        """Every unfinished turn ends now (its streams are cancelled); later text opens a new turn."""
        for t in self.turns:
            t.cancelled = True
            t.more.set()
            if t.task is not None:
                t.task.cancel()
        self.open = None

    def close(self) -> None:
        """`cancel`, then `run` ends after the last turn_done (with `context_closed`)."""
        self.cancel()
        self.closing = True
        self.queued.put_nowait(None)

    def _open_turn(self, speed: float | None) -> Turn:
        if self.open is None:
            text = SentenceQueue(max_pending_chars=self.voice.max_pending_chars)
            self.open = Turn(self.next_turn, text, speed if speed is not None else self.voice.config.speed)
            self.next_turn += 1
            self.turns.append(self.open)
            self.queued.put_nowait(self.open)
        return self.open

    # -- speaking (the context's task) ------------------------------------------------------------
    async def run(self) -> None:
        """Speak the queued turns one after another, each answered by its `turn_done`."""
        while (turn := await self.queued.get()) is not None:
            if not turn.cancelled:
                turn.task = asyncio.create_task(self._speak(turn))
                await asyncio.wait([turn.task])
            self.turns.remove(turn)
            usage = {"output_tokens": turn.rows, "segments": turn.segments}
            self.out.touch()
            with contextlib.suppress(Exception):  # the client may be gone
                await self.out.send_json(
                    self._tagged(
                        {"type": "turn_done", "turn": turn.index, "cancelled": turn.cancelled, "usage": usage}
                    )
                )
        with contextlib.suppress(Exception):
            await self.out.send_json(self._tagged({"type": "context_closed"}))

    async def stop(self, task: asyncio.Task[None]) -> None:
        """The socket is gone: every turn cancelled, `task` (this context's `run`) ended."""
        self.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for t in list(self.turns):
            if t.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await t.task

    async def _speak(self, turn: Turn) -> None:
        v, cfg = self.voice, self.voice.config
        framer = Framer(AudioFormat(cfg.response_format), StreamFormat.AUDIO, v.sample_rate, speed=turn.speed)
        timeline = Timeline(v.sample_rate * turn.speed)
        session, started = v.session, v.session.started
        try:
            async with contextlib.aclosing(session.spoken(turn.text, turn.more, SENTENCE_QUIET_S)) as pieces:
                async for spoken in pieces:
                    turn.rows += spoken.piece.rows
                    turn.segments = session.started - started
                    timeline.add(spoken.segment, spoken.text, len(spoken.piece.pcm))
                    await self._send_audio(turn, framer.piece(spoken.piece.pcm), timeline)
            await self._send_audio(turn, framer.end(turn.rows), timeline)
        except GatewayError as exc:
            turn.cancelled = True
            log.info("gateway: WebSocket turn %d failed: %s", turn.index, exc.error)
            event = {"type": "error", "code": exc.error.code.value, "message": str(exc.error)}
            with contextlib.suppress(Exception):
                await self.out.send_json(self._tagged({**event, "param": exc.param, "turn": turn.index}))
        except Exception as exc:  # the socket broke under a send: the receive side ends the connection
            turn.cancelled = True
            log.debug("gateway: WebSocket turn %d ended: %r", turn.index, exc)
        finally:
            turn.segments = session.started - started

    async def _send_audio(self, turn: Turn, data: bytes, timeline: Timeline) -> None:
        if not data:
            return
        if self.voice.config.audio == "binary":
            await self.out.send_bytes(data)
            return
        event = {"type": "audio", "turn": turn.index, "audio": base64.b64encode(data).decode()}
        await self.out.send_json(self._tagged({**event, "segment": timeline.segment()}))


class Timeline:
    """Where each spoken segment lies in its turn's audio, in seconds: the samples the model gave
    before it, over `rate` (the model's sample rate times the turn's speed: `atempo` plays
    `speed` input seconds per second). Exact at speed 1 (the PCM's own samples); under `atempo`
    its mapping, which holds a few milliseconds in its filter at any moment."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.samples = 0  # the turn's so far
        self.current = -1  # the session's index of the segment speaking
        self.text = ""
        self.index = -1  # its place in the turn, from 0
        self.start = 0

    def add(self, segment: int, text: str, samples: int) -> None:
        if segment != self.current:
            self.current, self.text, self.start = segment, text, self.samples
            self.index += 1
        self.samples += samples

    def segment(self) -> dict[str, Any]:
        """The segment the audio sent now belongs to: its text, its start, and its end so far
        (its last frame's `end_s` is its end)."""
        return {
            "index": self.index,
            "text": self.text,
            "start_s": round(self.start / self.rate, 6),
            "end_s": round(self.samples / self.rate, 6),
        }
