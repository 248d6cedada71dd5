"""The gateway's bounds against hostile input, without a server: sentence splitting in time linear
in the text (the shapes pysbd was superlinear on) and within its budget; WebSocket frames refused
by size and nesting before they are parsed, errors that quote no large field; a later segment the
unit sheds is tried again, the first and a segment that already spoke are not; a voice's deletion
waits for the sessions speaking with it; the connection cap leaves the process's own files room."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest

from tandem.gateway.connection_guard import FD_RESERVE, ServerLimits, effective
from tandem.gateway.sentences import MAX_MARKS, SentenceQueue, segments
from tandem.gateway.session import SpeechSession
from tandem.gateway.stream import GatewayError
from tandem.gateway.voice_users import VoiceUsers
from tandem.gateway.ws import MAX_DEPTH, MAX_FRAME_CHARS, QUOTE_CHARS, FrameError, parse_frame

# ---- sentence splitting ---------------------------------------------------------------------------

HOSTILE = {  # each took pysbd 0.78-1.57 s of CPU in one call before
    "newlines": "a\n" * 4000,
    "numbered": "1. " * 2700,
    "initials": "a. " * 2700,
}


@pytest.mark.parametrize("shape", sorted(HOSTILE))
def test_hostile_text_splits_in_little_cpu_and_keeps_every_word(shape: str) -> None:
    text = HOSTILE[shape]
    t0 = time.thread_time()
    out = segments(text)
    spent = time.thread_time() - t0
    assert spent < 0.25, f"{spent:.3f} s of CPU for {len(text)} characters"
    assert " ".join(out).split() == text.split() and max(map(len, out)) <= 300


def test_cost_grows_linearly_with_the_text() -> None:
    def cpu(text: str) -> float:
        t0 = time.thread_time()
        segments(text)
        return time.thread_time() - t0

    prose = "The quick brown fox, who was tired, jumped over the lazy dog. Then it slept until noon!\n"
    small, large = min(cpu(prose * 20) for _ in range(3)), min(cpu(prose * 160) for _ in range(3))
    assert large < 8 * 2.5 * small, (small, large)  # 8x the text; quadratic would be 64x


def test_past_its_budget_a_queue_splits_by_the_plain_rule() -> None:
    q = SentenceQueue(budget_s=0.0)
    q.feed("Dr. Smith came. He sat down! Did he stay? Yes.")
    q.flush()
    got = [q.take() for _ in range(2)]
    assert got == ["Dr.", "Smith came. He sat down! Did he stay? Yes."]  # no abbreviation rules now
    assert q.spent_s == 0.0


def test_a_line_with_many_marks_skips_pysbd() -> None:
    few, many = SentenceQueue(), SentenceQueue()
    few.feed("Dr. Who came. " * (MAX_MARKS // 2))
    many.feed("Dr. Who came. " * (MAX_MARKS // 2 + 1))
    assert few.take() == "Dr. Who came."  # pysbd knows the abbreviation
    assert many.take() == "Dr."  # the plain rule does not


# ---- WebSocket frames -----------------------------------------------------------------------------


def test_a_deeply_nested_frame_is_refused_before_parsing() -> None:
    raw = "[" * 100_000 + "]" * 100_000
    with pytest.raises(FrameError, match=f"frame is {len(raw)} characters; the limit is {MAX_FRAME_CHARS}"):
        parse_frame(raw)
    raw = '{"type": "text", "text": ' + "[" * 1000 + "]" * 1000 + "}"
    with pytest.raises(FrameError, match=f"nests 1001 levels of JSON; the limit is {MAX_DEPTH}"):
        parse_frame(raw)
    assert parse_frame(json.dumps({"type": "text", "text": "[[[[ {{{ not nesting"})).text.startswith("[[[[")


def test_an_error_quotes_no_large_field() -> None:
    with pytest.raises(FrameError) as e:
        parse_frame(json.dumps({"type": "x" * 60_000}))
    assert len(str(e.value)) < 3 * QUOTE_CHARS + 100 and "60002 characters" in str(e.value)
    with pytest.raises(FrameError, match="the limit is 65536"):
        parse_frame(json.dumps({"type": "x" * 10_000_000}))


# ---- a session keeps its later segments -----------------------------------------------------------


class Shed(Exception):
    """What the unit answers a segment it has no room for."""


def _queue(text: str) -> SentenceQueue:
    q = SentenceQueue(max_chars=40)
    q.feed(text)
    q.flush()
    return q


TEXT = "One is first. Two comes next here. Three follows it now."


class SheddingStreams:
    """Segment `index` is shed `sheds` times before it speaks; a segment that spoke may fail after."""

    def __init__(self, index: int, sheds: int, fail_after_speaking: bool = False) -> None:
        self.index, self.sheds, self.fail_after = index, sheds, fail_after_speaking
        self.opened: list[int] = []

    async def __call__(self, text: str, index: int) -> AsyncIterator[tuple[int, int]]:
        self.opened.append(index)
        await asyncio.sleep(0.001)
        if index == self.index and self.sheds > 0:
            self.sheds -= 1
            raise Shed(f"segment {index} shed")
        yield index, 0
        if index == self.index and self.fail_after:
            raise Shed(f"segment {index} failed after speaking")
        yield index, 1


def _speak(streams: SheddingStreams, patience_s: float = 10.0) -> tuple[list[tuple[int, int]], int]:
    async def main() -> tuple[list[tuple[int, int]], int]:
        session = SpeechSession(streams, retryable=lambda e: isinstance(e, Shed), patience_s=patience_s)
        return [p async for p in session.speak(_queue(TEXT))], session.retries

    return asyncio.run(main())


def test_a_later_segment_shed_is_tried_again_and_the_audio_is_whole() -> None:
    streams = SheddingStreams(index=1, sheds=3)
    out, retries = _speak(streams)
    n = len(segments(TEXT, 40))
    assert out == [(i, k) for i in range(n) for k in range(2)] and retries == 3
    assert streams.opened.count(1) == 4


def test_the_first_segment_and_one_that_spoke_are_not_tried_again() -> None:
    with pytest.raises(Shed, match="segment 0 shed"):
        _speak(SheddingStreams(index=0, sheds=1))
    with pytest.raises(Shed, match="segment 1 failed after speaking"):
        _speak(SheddingStreams(index=1, sheds=0, fail_after_speaking=True))


def test_past_its_patience_the_shed_is_raised() -> None:
    t0 = time.monotonic()
    with pytest.raises(Shed, match="segment 1 shed"):
        _speak(SheddingStreams(index=1, sheds=10_000), patience_s=0.5)
    assert time.monotonic() - t0 < 5.0


def test_closing_a_session_runs_its_hook_once() -> None:
    calls: list[int] = []
    session: SpeechSession[int] = SpeechSession(SheddingStreams(0, 0), on_close=lambda: calls.append(1))
    session.close()
    session.close()
    assert calls == [1]


# ---- a voice in use --------------------------------------------------------------------------------


def test_a_voice_in_use_is_deleted_when_its_last_session_ends() -> None:
    users, deleted = VoiceUsers(), []
    a, b = users.hold("ana"), users.hold("ana")
    assert users.defer_delete("ana", lambda: deleted.append("ana"))
    with pytest.raises(GatewayError, match="is deleted"):
        users.hold("ana")  # new sessions are refused at once
    a()
    a()  # twice is once
    assert deleted == [] and users.deleting("ana")
    b()
    assert deleted == ["ana"] and not users.deleting("ana")
    assert not users.defer_delete("bo", lambda: deleted.append("bo"))  # nobody holds it: now
    users.hold("ana")()  # the name is free again


# ---- descriptors ------------------------------------------------------------------------------------


def test_the_cap_leaves_the_files_open_at_start_their_room() -> None:
    lim = ServerLimits(max_connections=100_000, max_per_client=100_000)
    bare, loaded = effective(lim, 4096), effective(lim, 4096, in_use=500)
    assert bare.max_connections - loaded.max_connections >= 500 - (bare.backlog - loaded.backlog) - 64
    total = loaded.max_connections + loaded.backlog + loaded.linger_cap + 500 + FD_RESERVE
    assert total <= 4096
