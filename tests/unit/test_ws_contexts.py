"""The stream-input WebSocket's state machine without a server (`gateway/ws.py`, `ws_context.py`):
a socket object that records what is sent and a session whose streams are plain async generators.
The real gateway and tritonserver: tests/integration/test_stream_input.py.

What these can catch: a context's cancel or close leaking into another's turns, a closed context
that never answers or never frees its slot, the socket's two stream slots leaked by a cancelled
turn, the idle clock ignoring pings or speech, a lone sentence left silent without a flush.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from tandem.gateway.connection_guard import PINGS_EXTENSION, ClientPings
from tandem.gateway.sentences import SentenceQueue
from tandem.gateway.session import SpeechSession
from tandem.gateway.stream import AudioPiece, SpeechModel
from tandem.gateway.ws import MAX_CONTEXTS, MAX_TURNS, Connection

RATE = 100  # samples per second of the stand-in model: each piece is 0.1 s
PIECE = np.zeros(10, dtype=np.float32)


class Streams:
    """Each segment: `pieces` pieces of `PIECE`, one per `delay`; counts open streams."""

    def __init__(self, pieces: int = 3, delay: float = 0.005) -> None:
        self.pieces, self.delay = pieces, delay
        self.open = 0
        self.most_open = 0
        self.opened: list[str] = []

    async def __call__(self, text: str, index: int) -> AsyncIterator[AudioPiece]:
        self.opened.append(text)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            for _ in range(self.pieces):
                await asyncio.sleep(self.delay)
                yield AudioPiece(PIECE, 1)
        finally:
            self.open -= 1


class Socket:
    """What `Connection` uses of Starlette's WebSocket; the test feeds `incoming`."""

    def __init__(self, pings: ClientPings | None = None) -> None:
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[Any] = []
        self.closed: tuple[int, str] | None = None
        self.scope: dict[str, Any] = {"extensions": {PINGS_EXTENSION: {"pings": pings or ClientPings()}}}
        self.changed = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        return await self.incoming.get()

    async def send_text(self, text: str) -> None:
        self.sent.append(json.loads(text))
        self.changed.set()

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)
        self.changed.set()

    async def close(self, code: int = 1000, reason: str | None = None) -> None:
        self.closed = (code, reason or "")
        self.changed.set()

    def send(self, **frame: Any) -> None:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(frame)})

    def events(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.sent
            if isinstance(e, dict) and e["type"] == kind and all(e.get(k) == v for k, v in match.items())
        ]

    async def until(self, cond: Any, timeout_s: float = 10.0) -> None:
        async def changes() -> None:
            while not cond():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(changes(), timeout_s)


class Gateway:
    """The `Speaker` the socket needs: one stand-in model, sessions over `streams`."""

    def __init__(self, streams: Streams, idle_s: float = 60.0) -> None:
        self.streams = streams
        self.ws_limits = (idle_s, 8192)
        self.sessions: list[SpeechSession[AudioPiece]] = []

    def model(self, name: str) -> SpeechModel:
        return SpeechModel(name, RATE, 1, frozenset({"TEXT"}))

    def session(
        self, model: SpeechModel, voice: str, seed: int | None
    ) -> tuple[int, SpeechSession[AudioPiece]]:
        session: SpeechSession[AudioPiece] = SpeechSession(self.streams)
        self.sessions.append(session)
        return 1, session


async def _open(gw: Gateway, sock: Socket, **config: Any) -> asyncio.Task[None]:
    conn = Connection(sock, gw)  # type: ignore[arg-type]
    task = asyncio.create_task(conn.run())
    sock.send(type="config", model="m", voice="v", **config)
    await sock.until(lambda: sock.events("ready") or sock.events("error"))
    return task


def test_cancelling_one_context_leaves_the_others_turn_whole_and_frees_the_slots():
    streams = Streams(pieces=200)  # long segments: "a" is mid-speech at its cancel

    async def main() -> Socket:
        sock, gw = Socket(), Gateway(streams)
        task = await _open(gw, sock, audio="json")
        sock.send(type="text", text="One. Two. Three. Four.", context_id="a")
        sock.send(type="flush", context_id="a")
        await sock.until(lambda: streams.open == 2)  # "a" holds both slots of the socket
        sock.send(type="text", text="Other.", context_id="b")
        sock.send(type="flush", context_id="b")
        await asyncio.sleep(0.05)
        assert streams.open == 2 and streams.opened == ["One.", "Two. Three. Four."]  # "b" waits for a slot
        sock.send(type="cancel", context_id="a")
        await sock.until(lambda: sock.events("turn_done", context_id="b"))
        sock.send(type="close")
        await task
        assert gw.sessions[0]._slots._value == 2  # every slot given back
        return sock

    sock = asyncio.run(main())
    (a_done,) = sock.events("turn_done", context_id="a")
    (b_done,) = sock.events("turn_done", context_id="b")
    assert (
        a_done["cancelled"]
        and not b_done["cancelled"]
        and b_done["usage"] == {"output_tokens": 200, "segments": 1}
    )
    assert streams.opened[2] == "Other." and streams.open == 0 and streams.most_open == 2


def test_close_context_answers_each_turn_then_context_closed_and_frees_its_place():
    streams = Streams()

    async def main() -> Socket:
        sock, gw = Socket(), Gateway(streams)
        task = await _open(gw, sock, audio="json")
        for i in range(MAX_CONTEXTS):
            sock.send(type="text", text=f"Context {i} waits", context_id=f"c{i}")  # no sentence: silent
        sock.send(type="text", text="Sixth.", context_id="c5")
        await sock.until(lambda: sock.events("error"))
        sock.send(type="close_context", context_id="c0")
        await sock.until(lambda: sock.events("context_closed"))
        sock.send(type="text", text="Sixth.", context_id="c5")
        sock.send(type="flush", context_id="c5")
        await sock.until(lambda: sock.events("turn_done", context_id="c5"))
        sock.send(type="close")
        await task
        return sock

    sock = asyncio.run(main())
    (err,) = sock.events("error")
    assert err["param"] == "context_id" and "5 contexts are open" in err["message"]
    c0 = [e for e in sock.sent if isinstance(e, dict) and e.get("context_id") == "c0"]
    assert c0 == [
        {
            "type": "turn_done",
            "turn": 0,
            "cancelled": True,
            "usage": {"output_tokens": 0, "segments": 0},
            "context_id": "c0",
        },
        {"type": "context_closed", "context_id": "c0"},
    ]
    assert sock.events("turn_done", context_id="c5")[0]["cancelled"] is False


def test_a_lone_sentence_speaks_after_the_quiet_without_a_flush():
    streams = Streams(pieces=1)

    async def main() -> float:
        sock, gw = Socket(), Gateway(streams)
        task = await _open(gw, sock)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        sock.send(type="text", text="Hello there.")
        await sock.until(lambda: any(isinstance(e, bytes) for e in sock.sent))
        waited = loop.time() - t0
        sock.send(type="close")
        await task
        return waited

    waited = asyncio.run(main())
    assert streams.opened == ["Hello there."] and 0.2 <= waited < 2


def test_pings_and_speech_hold_the_socket_and_silence_closes_it():
    streams = Streams(pieces=150, delay=0.01)  # a turn speaks 1.5 s, past the idle limit

    async def main() -> tuple[Socket, float]:
        pings = ClientPings()
        sock, gw = Socket(pings), Gateway(streams)
        task = await _open(gw, sock, inactivity_timeout=1)
        loop = asyncio.get_running_loop()
        for _ in range(8):  # 1.6 s of pings only
            pings.last = loop.time()
            await asyncio.sleep(0.2)
        assert sock.closed is None
        sock.send(type="text", text="Long enough to outlast a second.")
        sock.send(type="flush")
        await sock.until(lambda: sock.events("turn_done"))
        t0 = loop.time()
        await task  # nothing more: closed one inactivity_timeout after the turn ended
        return sock, loop.time() - t0

    sock, waited = asyncio.run(main())
    assert sock.closed is not None and sock.closed[0] == 1008
    assert sock.events("error")[-1]["code"] == "UNAVAILABLE" and 0.9 <= waited < 2


@pytest.mark.parametrize(
    ("text", "settles"),
    [
        ("Hello there.", True),
        ("Hello there. ", True),
        ("Wait!", True),
        ("I met Dr. ", False),
        ("It costs", False),
    ],
)
def test_settle_completes_only_what_pysbd_would_end(text, settles):
    q = SentenceQueue()
    q.feed(text)
    assert q.settle() is settles
    assert q.take() == (text.strip() if settles else None)


def test_frames_out_of_order_are_refused_and_the_socket_goes_on():
    """Each frame the state does not allow is one `error` naming it; none changes the state: after
    them the socket speaks its turn and a `close` ends it with 1000."""
    streams = Streams(pieces=1)

    async def main() -> Socket:
        sock, gw = Socket(), Gateway(streams)
        task = asyncio.create_task(Connection(sock, gw).run())  # type: ignore[arg-type]
        sock.send(type="text", text="Too early.")
        sock.send(type="flush")
        sock.send(type="cancel")
        sock.incoming.put_nowait({"type": "websocket.receive", "bytes": b"\x00"})
        sock.send(type="config", model="m", voice="v")
        sock.send(type="config", model="m", voice="v")
        sock.send(type="cancel")  # nothing to cancel on the default context: no answer
        sock.send(type="flush", context_id="a")  # a named context needs audio "json"
        sock.send(type="text", text="Fast. ", speed=2.0)
        sock.send(type="text", text="Slow.", speed=1.0)  # the open turn's speed is 2
        sock.send(type="flush")
        await sock.until(lambda: sock.events("turn_done"))
        sock.send(type="close")
        await task
        return sock

    sock = asyncio.run(main())
    events = [e for e in sock.sent if isinstance(e, dict) and e["type"] in ("error", "ready")]
    assert [(e["type"], e.get("param")) for e in events] == [
        ("error", "type"),
        ("error", "type"),
        ("error", "type"),
        ("error", None),
        ("ready", None),
        ("error", "type"),
        ("error", "context_id"),
        ("error", "speed"),
    ]
    assert [e["message"].split(" ")[0] for e in events[:3]] == ["text", "flush", "cancel"]
    assert all("before config" in e["message"] for e in events[:3])
    assert "binary frames are not accepted" in events[3]["message"]
    assert "config was sent already" in events[5]["message"]
    assert 'needs config audio "json"' in events[6]["message"]
    assert "speed 1 for a turn opened at 2" in events[7]["message"]
    (done,) = sock.events("turn_done")
    assert streams.opened == ["Fast."]  # the refused text was dropped
    assert done["turn"] == 0 and not done["cancelled"]
    assert sock.closed == (1000, "")


class HeldTurns(Streams):
    """A segment of a text that starts "Turn" streams until it is closed; any other, one piece."""

    async def __call__(self, text: str, index: int) -> AsyncIterator[AudioPiece]:
        self.pieces = 10**9 if text.startswith("Turn") else 1
        async for piece in super().__call__(text, index):
            yield piece


def test_a_socket_holds_at_most_max_turns_and_a_cancel_frees_them():
    """`MAX_TURNS` flushed turns wait or speak; the next text is refused (param type) and kept out
    of every turn; a cancel answers each turn cancelled, and the next text opens turn MAX_TURNS + 1."""
    streams = HeldTurns()  # the first turn speaks until cancelled: every later one waits

    async def main() -> Socket:
        sock, gw = Socket(), Gateway(streams)
        task = await _open(gw, sock)
        for i in range(MAX_TURNS):
            sock.send(type="text", text=f"Turn {i}.")
            sock.send(type="flush")
        sock.send(type="text", text="One too many.")
        await sock.until(lambda: sock.events("error"), timeout_s=60)  # 17 texts through pysbd first
        sock.send(type="cancel")
        await sock.until(lambda: len(sock.events("turn_done")) == MAX_TURNS)
        sock.send(type="text", text="After.")
        sock.send(type="flush")
        await sock.until(lambda: sock.events("turn_done", turn=MAX_TURNS))
        sock.send(type="close")
        await task
        return sock

    sock = asyncio.run(main())
    (err,) = sock.events("error")
    assert err["param"] == "type" and f"{MAX_TURNS} turns are unfinished" in err["message"]
    dones = sock.events("turn_done")
    assert [d["turn"] for d in dones] == list(range(MAX_TURNS + 1))
    assert all(d["cancelled"] for d in dones[:MAX_TURNS]) and not dones[MAX_TURNS]["cancelled"]
    assert "One too many." not in streams.opened and streams.opened[-1] == "After."
    assert streams.open == 0
