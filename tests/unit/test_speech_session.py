"""The speech session without a server: pysbd's segments merged and split to size, text fed in pieces,
the pipeline's window, order, failure and cancellation (its streams here are plain async generators:
the gateway's real one is tested through the server in tests/integration/test_speech_session.py),
and the encoders and `atempo` decoded back with PyAV."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator

import av
import numpy as np
import pytest

from tandem.gateway.audio import AudioFormat, Framer, StreamFormat
from tandem.gateway.encode import CODECS, Encoder, Tempo, atempo_chain
from tandem.gateway.session import (
    SEGMENT_CHARS,
    BufferFull,
    SentenceQueue,
    SpeechSession,
    run_pipelined,
    segments,
    split_long,
)

PARAGRAPH = (
    "Dr. Smith arrived in Washington, D.C. at 5 p.m. on Friday. She had flown from St. Louis! "
    "Was the flight long? It was about two hours, she said, and the coffee was terrible. "
)


def _words(text: str) -> list[str]:
    return text.split()


# ---- segments -----------------------------------------------------------------------------------


def test_abbreviations_do_not_end_a_sentence_and_the_first_segment_is_one_sentence():
    out = segments(PARAGRAPH)
    assert out[0] == "Dr. Smith arrived in Washington, D.C. at 5 p.m. on Friday."
    assert (
        out[1]
        == "She had flown from St. Louis! Was the flight long? It was about two hours, she said, and the "
        "coffee was terrible."
    )


@pytest.mark.parametrize("max_chars", [40, 120, SEGMENT_CHARS])
def test_segments_keep_every_word_in_order_within_the_size(max_chars):
    text = PARAGRAPH * 12 + "And a last sentence without its full stop"
    out = segments(text, max_chars)
    assert _words(" ".join(out)) == _words(text)
    assert all(0 < len(s) <= max_chars for s in out)
    if max_chars == SEGMENT_CHARS:  # merged: each segment but the first and last nearly fills the size
        assert all(len(s) > SEGMENT_CHARS - 90 for s in out[1:-1])


def test_a_long_sentence_is_cut_at_a_clause_then_a_space_then_anywhere():
    sentence = "word " * 30 + "clause, " + "more " * 40 + "end."
    pieces = split_long(sentence, 200)
    assert pieces[0].endswith("clause,") and all(len(p) <= 200 for p in pieces)
    assert "".join(pieces) == sentence
    assert split_long("x" * 25, 10) == ["x" * 10, "x" * 10, "x" * 5]


def test_fed_in_pieces_a_sentence_is_spoken_once_the_next_begins():
    q = SentenceQueue()
    for piece in ["Hel", "lo the", "re.", " "]:
        q.feed(piece)
        assert q.take() is None  # "Hello there." may yet be "Hello there.com"
    q.feed("How")
    assert q.take() == "Hello there."
    q.feed(" are you? Fine")
    assert q.take() == "How are you?"  # merged with nothing: only complete sentences are taken
    assert not q.done
    q.flush()
    assert q.take() == "Fine" and q.take() is None and q.done


def test_a_fed_sentence_longer_than_the_size_is_spoken_in_pieces_before_it_ends():
    q = SentenceQueue(max_chars=50)
    q.feed("one two three four five six seven eight nine ten eleven twelve thirteen")
    assert q.take() == "one two three four five six seven eight nine ten"
    assert q.take() is None


def test_the_buffer_is_bounded_and_a_refused_piece_is_not_kept():
    q = SentenceQueue(max_pending_chars=20)
    q.feed("a" * 15)
    with pytest.raises(BufferFull, match="26 characters would wait unspoken; the limit is 20"):
        q.feed("b" * 11)
    q.feed("c" * 5)
    assert q.pending_chars == 20


def test_blank_text_makes_no_segment():
    assert segments("  \n\t ") == []
    q = SentenceQueue()
    q.feed("   ")
    q.flush()
    assert q.done and q.take() is None


# ---- the pipeline -------------------------------------------------------------------------------


class Streams:
    """Stand-in streams: each segment yields (index, k) pieces; records how many are open at once."""

    def __init__(self, pieces: int = 3, fail_at: int | None = None, delay: float = 0.002) -> None:
        self.pieces, self.fail_at, self.delay = pieces, fail_at, delay
        self.open = 0
        self.most_open = 0
        self.opened: list[str] = []
        self.closed: list[int] = []

    async def __call__(self, text: str, index: int) -> AsyncIterator[tuple[int, int]]:
        self.opened.append(text)
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            for k in range(self.pieces):
                await asyncio.sleep(self.delay)
                if index == self.fail_at and k == 1:
                    raise RuntimeError(f"segment {index} failed")
                yield index, k
        finally:
            self.open -= 1
            self.closed.append(index)


async def _until(cond, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def _queue(text: str) -> SentenceQueue:
    q = SentenceQueue(max_chars=40)
    q.feed(text)
    q.flush()
    return q


TEXT = "One is first. Two comes next here. Three follows it now. Four is the last one."


def test_pieces_come_in_segment_order_with_at_most_two_streams_open():
    streams = Streams()

    async def main() -> list[tuple[int, int]]:
        session = SpeechSession(streams)
        return [p async for p in session.speak(_queue(TEXT))]

    out = asyncio.run(main())
    n = len(segments(TEXT, 40))
    assert out == [(i, k) for i in range(n) for k in range(3)]
    assert streams.opened == segments(TEXT, 40) and streams.most_open == 2 and streams.open == 0


def test_a_failed_segment_fails_the_session_after_the_audio_before_it_and_closes_the_rest():
    streams = Streams(fail_at=1, pieces=4)

    async def main() -> list[tuple[int, int]]:
        got = []
        with pytest.raises(RuntimeError, match="segment 1 failed"):
            async for p in SpeechSession(streams).speak(_queue(TEXT)):
                got.append(p)
        return got

    got = asyncio.run(main())
    assert got == [(0, k) for k in range(4)] + [(1, 0)]
    assert streams.open == 0 and len(streams.opened) <= 3


def test_closing_the_session_closes_every_open_stream():
    streams = Streams(pieces=1000)

    async def main() -> None:
        session = SpeechSession(streams)
        gen = session.speak(_queue(TEXT))
        await anext(gen)
        await _until(lambda: streams.open == 2)  # the next segment's stream opens meanwhile
        await asyncio.sleep(0.02)
        assert streams.open == 2 and session.in_flight == 2  # and no third
        await gen.aclose()
        assert streams.open == 0 and session.in_flight == 0

    asyncio.run(main())
    assert sorted(streams.closed) == [0, 1]


def test_text_fed_while_speaking_is_spoken_in_the_same_turn():
    streams = Streams(pieces=2)

    async def main() -> list[tuple[int, int]]:
        q, more = SentenceQueue(), asyncio.Event()
        session = SpeechSession(streams)
        got: list[tuple[int, int]] = []

        async def listen() -> None:
            async for p in session.speak(q, more):
                got.append(p)

        task = asyncio.create_task(listen())
        q.feed("First sentence. Sec")
        more.set()
        await _until(lambda: len(got) == 2)
        await asyncio.sleep(0.02)
        assert got == [(0, 0), (0, 1)] and not task.done()  # spoken before the flush
        q.feed("ond sentence.")
        q.flush()
        more.set()
        await task
        return got

    assert asyncio.run(main()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert streams.opened == ["First sentence.", "Second sentence."]


def test_run_pipelined_keeps_two_started_and_the_order():
    log: list[str] = []

    def start(part: str, i: int) -> int:
        log.append(f"start {i}")
        return i

    def finish(i: int) -> str:
        log.append(f"finish {i}")
        return f"r{i}"

    assert list(run_pipelined(["a", "b", "c"], start, finish)) == ["r0", "r1", "r2"]
    assert log == ["start 0", "start 1", "finish 0", "start 2", "finish 1", "finish 2"]


# ---- encoders and speed, decoded back -----------------------------------------------------------


def _tone(rate: int, seconds: float) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(rate * seconds)) / rate)).astype(np.float32)


def _decode(data: bytes) -> tuple[int, np.ndarray]:
    with av.open(io.BytesIO(data)) as c:
        frames = [f.to_ndarray().reshape(-1) for f in c.decode(c.streams.audio[0])]
        return c.streams.audio[0].rate, np.concatenate(frames)


@pytest.mark.parametrize("fmt", sorted(CODECS))
@pytest.mark.parametrize("rate", [22050, 24000])
def test_each_encoder_streams_a_file_ffmpeg_decodes_to_the_input(fmt, rate):
    pcm = _tone(rate, 2.0)
    enc = Encoder(fmt, rate)
    chunks = [enc.encode(pcm[i : i + 2100]) for i in range(0, len(pcm), 2100)] + [enc.finish()]
    assert sum(1 for c in chunks[:-1] if c) > len(chunks) // 2  # bytes come as the audio does
    got_rate, out = _decode(b"".join(chunks))
    expected = round(len(pcm) * got_rate / rate)
    assert got_rate == (48000 if fmt == "opus" else rate)
    assert expected - 1 <= len(out) <= expected + 2 * 1152
    if fmt == "flac":
        assert np.array_equal(out, (np.clip(pcm, -1, 1) * 32767).round().astype(np.int16))


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 2.0, 4.0])
def test_tempo_changes_the_length_not_the_pitch(speed):
    rate = 24000
    pcm = _tone(rate, 2.0)
    t = Tempo(rate, speed)
    out = np.concatenate([t.push(pcm[i : i + 2400]) for i in range(0, len(pcm), 2400)] + [t.finish()])
    expected = len(pcm) / speed
    assert abs(len(out) - expected) <= max(0.01 * expected, rate // 50)  # 1 %, or atempo's 20 ms window
    spectrum = np.abs(np.fft.rfft(out[len(out) // 4 : 3 * len(out) // 4]))
    peak_hz = np.argmax(spectrum) * rate / (len(out) // 2)
    assert abs(peak_hz - 440) < 5


def test_atempo_chain_stays_in_each_filters_range():
    assert atempo_chain(0.25) == [0.5, 0.5] and atempo_chain(0.3) == pytest.approx([0.5, 0.6])
    assert atempo_chain(4.0) == [4.0]
    for bad in (0.2, 4.5, float("nan")):
        with pytest.raises(ValueError, match="outside"):
            atempo_chain(bad)


def test_the_framer_sends_the_encoders_tail_and_the_sse_usage_last():
    framer = Framer(AudioFormat.MP3, StreamFormat.SSE, 22050, speed=2.0)
    body = b"".join(framer.piece(p) for p in np.split(_tone(22050, 1.0), 10)) + framer.end(7, input_tokens=3)
    assert framer.media_type == "text/event-stream"
    assert body.endswith(b'"usage":{"input_tokens":3,"output_tokens":7,"total_tokens":10}}\n\n')


def test_run_pipelined_stops_starting_after_a_failure_and_finishes_the_started():
    log: list[str] = []

    def start(part: str, i: int) -> int:
        log.append(f"start {i}")
        return i

    def finish(i: int) -> int:
        log.append(f"finish {i}")
        return i

    assert list(run_pipelined(["a", "b", "c", "d"], start, finish, stop=lambda r: r == 0)) == [0]
    assert log == ["start 0", "start 1", "finish 0", "finish 1"]
