"""A speech session: text as users send it -> sentence segments -> one stream per segment, pipelined,
audio in order.

Who calls: `POST /v1/audio/speech` (`app.py`, the whole text at once), the WebSocket
(`ws.py`, text in pieces, one turn after another) and `TTSClient.speak` (`client.py`, gRPC, sync).
Nothing here speaks gRPC: the caller passes how one segment's stream is opened.

Segments (`SentenceQueue`):
- sentences by pysbd's English rules (`clean=False`: the text is kept as sent, abbreviations such as
  "Dr." and "p.m." do not end a sentence); fed in pieces, a sentence is complete once pysbd starts
  another after it, or at `flush`;
- one segment is as many whole sentences as fit in `max_chars` (`SEGMENT_CHARS`, 300: what one
  Orpheus stream speaks well, ~20 s of speech, within one stream's default length; Baseten's Orpheus
  example chunks at ~300 too), except a turn's first segment, which is its first sentence alone
  so the first audio waits on one sentence's prefill, not a paragraph's;
- a sentence longer than `max_chars` is split at the last clause mark (`,;:` or a dash) before the
  limit, else the last space, else at the limit (never a piece under half of it but the last).
Segments are stripped of surrounding whitespace and joined with one space; blank ones are dropped.

Pipelining (`SpeechSession.speak`): at most `window` (2) streams in flight per session; segment i+1's
stream starts once segment i's first audio has arrived (and a slot is free), so playback never waits
on a prefill, the first segment's prefill shares the engines with no other of the session, and no
more than two streams of one session hold the engines at once. Audio comes out in segment
order. A segment's error is raised at its place in the order (the audio before it is whole) and
cancels every other stream of the session; closing the generator (the caller left, a WebSocket
`cancel`) cancels every stream of the session, each by closing its async iterator (for the gateway's
`stream_audio`: the gRPC call is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Generic, TypeVar

import pysbd

SEGMENT_CHARS = 300  # one segment's most characters (module docstring)
WINDOW = 2  # streams in flight per session
_CLAUSE = re.compile(r"[,;:\u2013\u2014](?=\s)|\s[-\u2013\u2014]\s")

P = TypeVar("P")
R = TypeVar("R")
H = TypeVar("H")


class BufferFull(ValueError):
    """More unspoken text than the session holds (`SentenceQueue.max_pending_chars`)."""


def split_long(sentence: str, max_chars: int) -> list[str]:
    """`sentence` in pieces of at most `max_chars`: cut after the last clause mark, else the last
    space, in the second half of the limit; else at the limit."""
    out: list[str] = []
    rest = sentence
    while len(rest) > max_chars:
        window = rest[: max_chars + 1]
        cut = 0
        for m in _CLAUSE.finditer(window):
            if max_chars // 2 <= m.end() <= max_chars:
                cut = m.end()
        if not cut:
            space = window.rfind(" ", max_chars // 2)
            cut = space if space > 0 else max_chars
        out.append(rest[:cut])
        rest = rest[cut:]
    out.append(rest)
    return out


class SentenceQueue:
    """Text in, in any pieces; segments out (module docstring). Not thread-safe; one per turn."""

    def __init__(self, max_chars: int = SEGMENT_CHARS, max_pending_chars: int | None = None) -> None:
        if max_chars < 2:
            raise ValueError(f"max_chars = {max_chars}: at least 2")
        self.max_chars = max_chars
        self.max_pending_chars = max_pending_chars
        self._segmenter = pysbd.Segmenter(language="en", clean=False)
        self._buffer = ""  # text not yet known to end a sentence
        self._sentences: deque[str] = deque()  # complete sentences, none longer than max_chars
        self.first = True  # the next segment is the turn's first (spoken alone)
        self.flushed = False

    @property
    def pending_chars(self) -> int:
        """Characters fed and not yet taken."""
        return len(self._buffer) + sum(len(s) for s in self._sentences)

    def feed(self, text: str) -> None:
        """Add a piece of text; raises BufferFull (and keeps nothing of it) past `max_pending_chars`."""
        if self.max_pending_chars is not None and self.pending_chars + len(text) > self.max_pending_chars:
            raise BufferFull(
                f"{self.pending_chars + len(text)} characters would wait unspoken; the limit is "
                f"{self.max_pending_chars}"
            )
        self.flushed = False
        self._buffer += text
        parts = self._segmenter.segment(self._buffer) if self._buffer.strip() else []
        if len(parts) > 1:
            self._push(parts[:-1])
            self._buffer = parts[-1]
        if len(self._buffer) > self.max_chars:  # a sentence that will not fit: speak its head now
            *heads, self._buffer = split_long(self._buffer, self.max_chars)
            self._push(heads)

    def flush(self) -> None:
        """The text so far is complete: what is buffered becomes segments."""
        if self._buffer.strip():
            self._push(self._segmenter.segment(self._buffer))
        self._buffer = ""
        self.flushed = True

    def _push(self, sentences: Iterable[str]) -> None:
        for s in sentences:
            self._sentences.extend(split_long(s, self.max_chars))

    def take(self) -> str | None:
        """The next segment, or None when no complete sentence waits."""
        while self._sentences:
            segment = self._sentences.popleft().strip()
            while not self.first and self._sentences:  # pysbd may drop a boundary's space: one between
                nxt = self._sentences[0].strip()
                if len(segment) + 1 + len(nxt) > self.max_chars:
                    break
                segment = f"{segment} {nxt}" if segment and nxt else segment or nxt
                self._sentences.popleft()
            if segment:
                self.first = False
                return segment
        return None

    @property
    def done(self) -> bool:
        """Flushed and everything taken."""
        return self.flushed and not self._sentences and not self._buffer.strip()


def segments(text: str, max_chars: int = SEGMENT_CHARS) -> list[str]:
    """A whole text's segments, in order."""
    q = SentenceQueue(max_chars)
    q.feed(text)
    q.flush()
    out = []
    while (s := q.take()) is not None:
        out.append(s)
    return out


_END = object()


class _Segment(Generic[P]):
    """One segment's stream, pumped into a queue by its own task."""

    def __init__(self, index: int, pieces: AsyncIterator[P]) -> None:
        self.index = index
        self.playing = asyncio.Event()  # its first audio (or its end) has arrived
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(pieces))

    async def _pump(self, pieces: AsyncIterator[P]) -> None:
        try:
            async for piece in pieces:
                self._queue.put_nowait(piece)
                self.playing.set()
            self._queue.put_nowait(_END)
        except Exception as exc:
            self._queue.put_nowait(exc)
        finally:
            self.playing.set()
            aclose = getattr(pieces, "aclose", None)
            if aclose is not None:
                await aclose()

    async def pieces(self) -> AsyncIterator[P]:
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, Exception):
                raise item
            yield item  # type: ignore[misc]

    async def cancel(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class SpeechSession(Generic[P]):
    """Segments of one `SentenceQueue` spoken by `open_stream(segment, index)`, pipelined.

    `open_stream` returns the segment's audio pieces as an async iterator (the gateway's
    `stream_audio`), raising its error. Several turns may use one session one after another
    (`speak` per turn); `in_flight` counts its open streams."""

    def __init__(self, open_stream: Callable[[str, int], AsyncIterator[P]], window: int = WINDOW) -> None:
        self.open_stream = open_stream
        self.window = window
        self.started = 0  # streams opened by this session, over all its turns
        self.in_flight = 0

    async def speak(self, text: SentenceQueue, more: asyncio.Event | None = None) -> AsyncIterator[P]:
        """Yields the pieces of every segment `text` gives, in order, until `text` is done.

        `more`: set by whoever feeds or flushes `text` while this runs (the WebSocket); None when
        `text` was flushed before (a whole text)."""
        slots = asyncio.Semaphore(self.window)
        order: asyncio.Queue[_Segment[P] | Exception | None] = asyncio.Queue()
        live: list[_Segment[P]] = []

        async def starter() -> None:
            try:
                while True:
                    await slots.acquire()
                    while (segment := text.take()) is None:
                        if text.done or more is None:
                            order.put_nowait(None)
                            return
                        more.clear()
                        await more.wait()
                    seg = _Segment(self.started, self._counted(segment, self.started))
                    self.started += 1
                    live.append(seg)
                    order.put_nowait(seg)
                    await seg.playing.wait()  # the next prefill waits for this one's first audio
            except Exception as exc:  # the segmenter's: ends the turn with it
                order.put_nowait(exc)

        start = asyncio.create_task(starter())
        try:
            while (seg := await order.get()) is not None:
                if isinstance(seg, Exception):
                    raise seg
                async for piece in seg.pieces():
                    yield piece
                live.remove(seg)
                slots.release()
        finally:
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            for seg in live:
                await seg.cancel()

    async def _counted(self, segment: str, index: int) -> AsyncIterator[P]:
        """`open_stream`'s pieces; its errors, the opening's included, raised in the segment's task."""
        self.in_flight += 1
        pieces: AsyncIterator[P] | None = None
        try:
            pieces = self.open_stream(segment, index)
            async for piece in pieces:
                yield piece
        finally:
            self.in_flight -= 1
            aclose = getattr(pieces, "aclose", None)
            if aclose is not None:
                await aclose()


def run_pipelined(
    parts: list[str],
    start: Callable[[str, int], H],
    finish: Callable[[H], R],
    window: int = WINDOW,
    stop: Callable[[R], bool] | None = None,
) -> Iterator[R]:
    """The synchronous form (`TTSClient.speak`): `start(part, index)` opens a stream and returns a
    handle, `finish(handle)` waits for its result; at most `window` started and unfinished, results in
    order. After a result `stop` says yes to (a failed segment), nothing more starts: the ones started
    are finished and dropped."""
    started: deque[H] = deque()
    nxt = 0
    while nxt < len(parts) or started:
        while nxt < len(parts) and len(started) < window:
            started.append(start(parts[nxt], nxt))
            nxt += 1
        result = finish(started.popleft())
        yield result
        if stop is not None and stop(result):
            for handle in started:
                finish(handle)
            return
