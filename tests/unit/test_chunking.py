"""Chunk sizes that follow a real-time listener's lead (`backend/codec/chunking.py`).

The judge is what a listener hears: it plays a stream's audio at real time from its first sounding
chunk on, and a chunk that arrives after the audio before it has run out is a stall (the rule of
`bench/capacity.py`, counted here in sounding frames). A stream generated at 1.2x real time must
never stall with sizes that follow the lead, where the fixed schedule does; the first chunk stays
as small as the fixed schedule's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest

from tandem.backend.codec.base import Framing
from tandem.backend.codec.chunking import ChunkPolicy
from tandem.backend.codec.config import VocoderConfig
from tandem.backend.codec.orpheus import OrpheusLayout
from tandem.backend.codec.reference import ReferenceVocoder
from tandem.backend.engines.parts import chunk_policy, make_batch, make_pool
from tandem.backend.engines.stream import Chunk
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder
from tandem.backend.settings import PoolSettings, parse_settings
from tests.support.engines import Job

ORPHEUS_RT = 24000 / 2048 * 7  # 82.03125 rows/s
REFERENCE = ChunkPolicy(lead_fraction=0.5)  # the CPU default's: 4 first, up to 32, 21 rows/s
ORPHEUS = ChunkPolicy(
    14, 2.0, 112, Framing(OrpheusLayout(), 2, 1), lead_fraction=0.5, rows_per_second=ORPHEUS_RT
)


def stalls(arrivals: list[tuple[float, int]], frame_s: float) -> int:
    """Stalls a real-time listener hears: `arrivals` are (time, frames that sound) per chunk."""
    count, played_until = 0, None
    for t, frames in arrivals:
        if played_until is None:
            if frames:  # playback starts with the first audio
                played_until = t + frames * frame_s
            continue
        if t > played_until:
            count += 1
            played_until = t
        played_until += frames * frame_s
    return count


def simulate(policy: ChunkPolicy, rows: int, rate: float, width: int = 1) -> tuple[list[int], list[float]]:
    """A stream of `rows` audio rows generated at `rate` rows/s, cut as D cuts it (the size chosen
    when the previous chunk left, from the lead then). Returns the chunk sizes and the listener's lead
    at each chunk's arrival, before its audio (negative: it stalled)."""
    track = policy.framing.track(width)
    sizes: list[int] = []
    leads: list[float] = []
    since: float | None = None
    want = policy.next_rows(0, None)
    pending = 0
    for i in range(1, rows + 1):
        pending += 1
        done = i == rows
        if pending < want and not done:
            continue
        now = i / rate
        if since is not None:
            lead = policy.lead_s(track.emitted, since, now)
            assert lead is not None
            leads.append(lead)
        track.push(np.full((pending, width), 128266, dtype=np.int64))  # an Orpheus audio id
        sent = track.emitted
        track.window(final=done)
        since = policy.playing_since(sent, track.emitted, since, now)
        sizes.append(pending)
        pending = 0
        want = policy.next_rows(len(sizes), policy.lead_s(track.emitted, since, now))
    return sizes, leads


def test_the_ladder_is_whole_frames_from_one_frame_to_the_largest_chunk() -> None:
    assert REFERENCE.ladder == (1, 2, 4, 8, 16, 32)
    assert ORPHEUS.ladder == (7, 14, 28, 56, 112)
    assert ChunkPolicy(lead_fraction=0.5, growth=1.0, max_rows=5).ladder == (1, 2, 3, 4, 5)
    assert ChunkPolicy(lead_fraction=0.5, growth=1.5, max_rows=10, min_rows=3).ladder == (3, 4, 6, 9, 10)
    assert ChunkPolicy(14, 2.0, 30, Framing(OrpheusLayout()), lead_fraction=0.5).ladder == (7, 14, 28, 30)


def test_the_first_chunk_and_every_chunk_before_audio_keep_the_first_size() -> None:
    for lead in (None, 0.0, 10.0):
        assert ORPHEUS.next_rows(0, lead) == 14
        assert REFERENCE.next_rows(0, lead) == 4
    assert ORPHEUS.next_rows(3, None) == 14  # nothing sounds yet: nobody is listening


def test_the_size_is_the_largest_rung_whose_audio_fits_the_lead_share() -> None:
    frame = 2048 / 24000
    assert ORPHEUS.lead_s(1, 5.0, 5.0) == pytest.approx(frame)
    assert ORPHEUS.lead_s(10, 5.0, 5.5) == pytest.approx(10 * frame - 0.5)
    assert ORPHEUS.lead_s(10, None, 5.5) is None
    assert ORPHEUS.next_rows(1, frame) == 7  # below one frame's share: the smallest rung
    assert ORPHEUS.next_rows(1, -1.0) == 7  # already stalled: still the smallest, never nothing
    assert ORPHEUS.next_rows(1, 4 * frame) == 14  # half of 4 frames: 2 frames
    assert ORPHEUS.next_rows(1, 4 * frame - 1e-3) == 7
    assert ORPHEUS.next_rows(1, 3.0) == 112  # seconds buffered: the largest
    assert REFERENCE.next_rows(1, 4 / 21) == 2  # the first chunk's 4 rows allow 2 (exactly on the rung)
    assert [REFERENCE.next_rows(5, n / 21) for n in (1, 2, 4, 8, 16, 32, 64, 1000)] == [
        1,
        1,
        2,
        4,
        8,
        16,
        32,
        32,
    ]


def test_the_listener_starts_with_the_first_sound_and_resumes_after_a_stall() -> None:
    frame = 2048 / 24000
    assert ORPHEUS.playing_since(0, 0, None, 3.0) is None  # nothing sounds yet
    assert ORPHEUS.playing_since(0, 1, None, 3.0) == 3.0
    assert ORPHEUS.playing_since(1, 3, 3.0, 3.05) == 3.0  # 85 ms sent, 50 ms played: no stall
    slipped = ORPHEUS.playing_since(1, 3, 3.0, 3.5)  # ran dry at 3.085, this chunk came at 3.5
    assert slipped == pytest.approx(3.5 - frame)
    assert ORPHEUS.lead_s(3, slipped, 3.5) == pytest.approx(2 * frame)  # the new chunk's audio, no debt
    # a stream that was late once, then runs at 1.5x, climbs the ladder again
    since, sent, now = slipped, 3, 3.5
    for _ in range(60):
        now += 28 / (1.5 * ORPHEUS_RT)
        since = ORPHEUS.playing_since(sent, sent + 4, since, now)
        sent += 4
    assert ORPHEUS.next_rows(9, ORPHEUS.lead_s(sent, since, now)) == 112


def test_fraction_zero_is_the_fixed_schedule() -> None:
    fixed = ChunkPolicy()
    assert not fixed.follows_lead
    assert [fixed.next_rows(i, 10.0) for i in range(6)] == [4, 8, 16, 32, 32, 32]
    assert [fixed.next_rows(i, None) for i in range(6)] == [fixed.next_size(i) for i in range(6)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lead_fraction": -0.1}, r"lead_fraction must be in \[0, 1\]"),
        ({"lead_fraction": 1.5}, r"lead_fraction must be in \[0, 1\]"),
        ({"lead_fraction": float("nan")}, r"lead_fraction must be in \[0, 1\]"),
        ({"min_rows": -1}, r"min_rows must be in \[0, max_rows=32\]"),
        ({"min_rows": 33}, r"min_rows must be in \[0, max_rows=32\]"),
        ({"rows_per_second": 0.0}, "rows_per_second must be a positive number"),
    ],
)
def test_the_policy_rejects(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("batch.chunk_lead_fraction", "2", r"'batch.chunk_lead_fraction': must be in \[0, 1\]"),
        ("batch.chunk_lead_fraction", "inf", r"'batch.chunk_lead_fraction': must be in \[0, 1\]"),
        ("batch.min_chunk_rows", "33", r"'batch.min_chunk_rows': must be in \[0, batch.max_chunk_rows=32\]"),
        ("batch.min_chunk_rows", "-2", r"'batch.min_chunk_rows'"),
        ("batch.first_chunk_rows", "0", r"'batch.first_chunk_rows': must be >= 1"),
        ("batch.chunk_growth", "0.5", r"'batch.chunk_growth': must be a finite number >= 1"),
        ("batch.max_chunk_rows", "2", r"'batch.max_chunk_rows': must be >= batch.first_chunk_rows \(4\)"),
        ("batch.chunk_lead_fraction", "half", "cannot parse 'half'"),
    ],
)
def test_settings_name_the_bad_chunk_parameter(key: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_settings({key: value})


def test_settings_build_the_policy_on_the_codecs_clock() -> None:
    p = chunk_policy(parse_settings({}))
    assert (p.first_rows, p.max_rows, p.lead_fraction, p.rows_per_second, p.ladder) == (
        4,
        32,
        0.5,
        21.0,
        (1, 2, 4, 8, 16, 32),
    )
    q = chunk_policy(parse_settings({"batch.chunk_lead_fraction": "0", "batch.min_chunk_rows": "2"}))
    assert not q.follows_lead and q.ladder[0] == 2


@pytest.mark.parametrize("policy", [REFERENCE, ORPHEUS], ids=["reference", "orpheus"])
def test_a_stream_at_1_2x_real_time_never_underruns_where_fixed_sizes_did(policy: ChunkPolicy) -> None:
    rt = policy.rows_per_second
    fixed = ChunkPolicy(policy.first_rows, policy.growth, policy.max_rows, policy.framing, rows_per_second=rt)
    rows = int(30 * rt)  # 30 s of audio
    old_sizes, old_leads = simulate(fixed, rows, 1.2 * rt)
    assert min(old_leads) < 0  # the fixed schedule's second chunk already arrives after the first ran out
    for speed in (1.2, 1.5, 3.0, 20.0):
        sizes, leads = simulate(policy, rows, speed * rt)
        assert min(leads) > 0, speed
        assert sizes[0] == policy.first_rows == old_sizes[0]  # first audio as early as before
        assert set(sizes[:-1]) <= set(policy.ladder) | {policy.first_rows}
        assert max(sizes) == policy.max_rows  # once seconds are buffered the chunks are the largest
    # at 1.2x the lead grows by a sixth of the wall time: small chunks for the first seconds
    sizes, _ = simulate(policy, rows, 1.2 * rt)
    assert sizes[1] == policy.ladder[0 if policy is ORPHEUS else 1]


@dataclass
class _Arrival:
    t: float
    chunk: Chunk


class _ClockedSink:
    """Records each chunk with the (simulated) time it left the engine."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.arrivals: list[_Arrival] = []

    def emit(self, chunk: Chunk) -> None:
        self.arrivals.append(_Arrival(self.clock[0], chunk))

    def fail(self, error: object) -> None:
        raise AssertionError(f"stream failed: {error}")

    def cancelled(self) -> bool:
        return False


@pytest.mark.parametrize("fraction", [0.0, 0.5], ids=["fixed", "lead"])
def test_the_decode_batch_at_1_2x_real_time(fraction: float) -> None:
    """The real running batch (tiny model, reference codec) with one step every 1 / (1.2 x 21) s of a
    simulated clock: the fixed schedule stalls the listener, the lead-following one never does, and
    the streamed audio is the whole stream's audio either way."""
    dec = Decoder.random(preset("tiny"), "cpu", seed=0)
    parsed = parse_settings({"batch.chunk_lead_fraction": str(fraction)})
    s = dataclasses.replace(parsed, pool=PoolSettings(num_pages=256, page_size=16))
    clock = [0.0]
    pool = make_pool(dec, s)
    batch = make_batch(dec, pool, s, RecordingMetrics(), clock=lambda: clock[0])
    job = Job(dec, pool, 0, 500)  # 500 rows: 23.8 s of audio, 19.8 s of wall time at 1.2x
    sink = _ClockedSink(clock)
    job.stream.sink = sink
    job.add_to(batch)
    step_s = 1 / (1.2 * 21)
    while len(batch):
        clock[0] += step_s
        batch.step()
    sizes = [a.chunk.rows.shape[0] for a in sink.arrivals]
    assert sum(sizes) == 500 and sizes[0] == 4
    heard = stalls([(a.t, a.chunk.window.emitted) for a in sink.arrivals if a.chunk.window], 1 / 21)
    if fraction == 0.0:
        assert heard > 0 and sizes[:4] == [4, 8, 16, 32]
    else:
        assert heard == 0 and max(sizes) == 32 and sizes[1] == 2
    vocoder = ReferenceVocoder(VocoderConfig())
    windows = [a.chunk.window for a in sink.arrivals if a.chunk.window is not None]
    streamed = np.concatenate(vocoder.decode(windows))
    rows = np.concatenate([a.chunk.rows for a in sink.arrivals])
    np.testing.assert_allclose(streamed, vocoder.synthesize(rows, 0), rtol=0, atol=1e-6)
