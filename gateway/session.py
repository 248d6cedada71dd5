"""A speech session: text as users send it -> sentence segments -> one stream per segment, pipelined,
audio in order.

Who calls: `POST /v1/audio/speech` (`app.py`, the whole text at once), the WebSocket
(`ws.py`, text in pieces, one turn after another) and `TTSClient.speak` (`client.py`, gRPC, sync).
Nothing here speaks gRPC: the caller passes how one segment's stream is opened.

Segments: `gateway/sentences.py` (`SentenceQueue`: pysbd sentences merged or cut to 300 characters,
in bounded time per character).

Pipelining (`SpeechSession.speak`): at most `window` (2) streams in flight per session; segment
i+1's stream starts once segment i's first audio has arrived (and a slot is free), so playback never
waits on a prefill, the first segment's prefill shares the engines with no other of the session, and
no more than two streams of one session hold the engines at once. Audio comes out in segment order.
A later segment the unit sheds before its first audio is tried again (`SpeechSession`), so an
admitted session is not cut by a busy unit; a segment's error is raised at its place in the order
(the audio before it is whole) and cancels every other stream of the session; closing the generator
(the caller left, a WebSocket `cancel`) cancels every stream of the session, each by closing its
async iterator (for the gateway's `stream_audio`: the gRPC call is cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from tandem.gateway.sentences import (  # noqa: F401  (re-exported: the session's text side)
    SEGMENT_CHARS,
    TEXT_EXECUTOR,
    BufferFull,
    SentenceQueue,
    segments,
    split_long,
)

WINDOW = 2  # streams in flight per session
SEGMENT_PATIENCE_S = 60.0  # how long a later segment the unit sheds is tried again
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0  # the wait between its tries, doubling

P = TypeVar("P")
R = TypeVar("R")
H = TypeVar("H")


_END = object()


@dataclass(frozen=True)
class Spoken(Generic[P]):
    """One piece of audio and the segment it speaks (`segment`: the session's count of it)."""

    segment: int
    text: str
    piece: P


class _Segment(Generic[P]):
    """One segment's stream, pumped into a queue by its own task."""

    def __init__(self, index: int, text: str, pieces: AsyncIterator[P]) -> None:
        self.index = index
        self.text = text
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
    (`speak` per turn); `in_flight` counts its open streams.

    A session whose first stream was admitted keeps its later segments: one of them that fails
    before its first audio with an error `retryable` says yes to (the unit shed it: no capacity
    within the admission wait, a full queue) is opened again (`open_stream` with the same index),
    after `RETRY_FIRST_S` doubling to `RETRY_MAX_S`, for up to `patience_s` — a wait without the
    engines' admission deadline, holding nothing on them meanwhile. Only then is its error raised
    (and the caller's response aborted, never ended as if complete). `close()` runs `on_close`
    once (the gateway's hold on the session's voice)."""

    def __init__(
        self,
        open_stream: Callable[[str, int], AsyncIterator[P]],
        window: int = WINDOW,
        retryable: Callable[[Exception], bool] | None = None,
        patience_s: float = SEGMENT_PATIENCE_S,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.open_stream = open_stream
        self.window = window
        self.retryable = retryable
        self.patience_s = patience_s
        self._on_close = on_close
        self.started = 0  # streams opened by this session, over all its turns
        self.in_flight = 0
        self.retries = 0  # segments opened again after a shed, over all its turns
        self._slots = asyncio.Semaphore(window)  # streams in flight, over every `spoken` at once

    def close(self) -> None:
        """The session is over (its caller left or was answered); idempotent."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()

    async def speak(
        self, text: SentenceQueue, more: asyncio.Event | None = None, quiet_s: float | None = None
    ) -> AsyncIterator[P]:
        """`spoken`'s pieces alone (closing this closes it, and so its streams, at once)."""
        async with contextlib.aclosing(self.spoken(text, more, quiet_s)) as pieces:
            async for spoken in pieces:
                yield spoken.piece

    async def spoken(
        self, text: SentenceQueue, more: asyncio.Event | None = None, quiet_s: float | None = None
    ) -> AsyncGenerator[Spoken[P], None]:
        """Yields the pieces of every segment `text` gives, in order, each with its segment, until
        `text` is done.

        `more`: set by whoever feeds or flushes `text` while this runs (the WebSocket); None when
        `text` was flushed before (a whole text). `quiet_s`: after this long without `more`, the
        buffered text is settled (`SentenceQueue.settle`): a complete last sentence speaks without
        waiting for the next one or a flush. A segment waits for one of the session's `window`
        slots, shared by every `spoken` running on it (a WebSocket's contexts)."""
        order: asyncio.Queue[_Segment[P] | Exception | None] = asyncio.Queue()
        live: list[_Segment[P]] = []
        held = 0  # slots this call holds: given back however it ends
        loop = asyncio.get_running_loop()

        async def next_segment() -> str | None:
            """The next segment once one is complete and a slot is free; None: the text is done."""
            nonlocal held
            settled = False
            while True:
                while not text.ready:
                    if more is None:
                        return None
                    more.clear()
                    if quiet_s is None or settled or not text.pending_chars:
                        await more.wait()
                        settled = False
                        continue
                    # Not wait_for: a cancel (the turn's) that meets `more` being set (the same
                    # `cancel` sets it) is swallowed by it, and this task would never end.
                    waiter = asyncio.ensure_future(more.wait())
                    try:
                        done, _ = await asyncio.wait({waiter}, timeout=quiet_s)
                    finally:
                        waiter.cancel()
                    if not done:
                        await loop.run_in_executor(TEXT_EXECUTOR, text.settle)
                    settled = not done
                if text.done:
                    return None
                await self._slots.acquire()
                held += 1
                if (segment := text.take()) is not None:
                    return segment
                self._slots.release()  # only blank sentences waited
                held -= 1

        async def starter() -> None:
            try:
                while (segment := await next_segment()) is not None:
                    seg = _Segment(self.started, segment, self._counted(segment, self.started))
                    self.started += 1
                    live.append(seg)
                    order.put_nowait(seg)
                    await seg.playing.wait()  # the next prefill waits for this one's first audio
                order.put_nowait(None)
            except Exception as exc:  # the segmenter's: ends the turn with it
                order.put_nowait(exc)

        start = asyncio.create_task(starter())
        try:
            while (seg := await order.get()) is not None:
                if isinstance(seg, Exception):
                    raise seg
                async for piece in seg.pieces():
                    yield Spoken(seg.index, seg.text, piece)
                live.remove(seg)
                self._slots.release()
                held -= 1
        finally:
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            for seg in live:
                await seg.cancel()
            for _ in range(held):
                self._slots.release()

    async def _counted(self, segment: str, index: int) -> AsyncIterator[P]:
        """`open_stream`'s pieces; its errors, the opening's included, raised in the segment's task;
        a later segment shed before its first audio is opened again (class docstring)."""
        self.in_flight += 1
        deadline = time.monotonic() + self.patience_s
        delay = RETRY_FIRST_S
        try:
            while True:
                pieces: AsyncIterator[P] | None = None
                spoke = False
                try:
                    pieces = self.open_stream(segment, index)
                    async for piece in pieces:
                        spoke = True
                        yield piece
                    return
                except Exception as exc:
                    patient = index > 0 and not spoke and self.retryable is not None
                    if not (patient and self.retryable(exc)) or time.monotonic() + delay > deadline:  # type: ignore[misc]
                        raise
                finally:
                    aclose = getattr(pieces, "aclose", None)
                    if aclose is not None:
                        await aclose()
                self.retries += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
        finally:
            self.in_flight -= 1


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
