"""`StreamResult`'s view of a stream as a listener hears it: the floor rule and playback stalls, on
arrival times chosen so the answer is known."""

from __future__ import annotations

import numpy as np

from tandem.gateway.client import StreamResult

RATE = 1000  # samples per second: one sample is a millisecond


def _result(arrivals_s: list[float], samples: list[int], rows: list[int]) -> StreamResult:
    r = StreamResult(stream_id=1)
    r.response_ns = [int(t * 1e9) for t in arrivals_s]
    r.response_samples = samples
    r.response_rows = rows
    r.rows = np.zeros((sum(rows), 1), dtype=np.int64)
    r.first_response_ns, r.done_ns = r.response_ns[0], r.response_ns[-1]
    return r


def test_audio_that_arrives_before_it_is_needed_never_stalls():
    r = _result([0.0, 0.5, 1.0], [1000, 1000, 1000], [10, 10, 10])
    assert r.playback_stalls(RATE) == (0, 0.0)


def test_a_late_response_is_one_stall_of_its_lateness():
    # 1 s of audio at t=0 plays out at t=1; the next arrives at 1.5 (0.5 s late), its 0.2 s play out
    # at 1.7; the last arrives at 1.75 (0.05 s late)
    stalls, seconds = _result([0.0, 1.5, 1.75], [1000, 200, 100], [10, 2, 1]).playback_stalls(RATE)
    assert stalls == 2 and abs(seconds - 0.55) < 1e-9


def test_responses_before_the_first_audio_start_no_clock():
    # a codec's lookahead: rows without audio first; playback starts at the first samples (t=0.3)
    r = _result([0.0, 0.3, 1.2], [0, 1000, 500], [4, 4, 4])
    assert r.playback_stalls(RATE) == (0, 0.0)


def test_the_floor_is_rows_per_second_over_the_rtf():
    # 20 rows in the 1 s after the first response: 20 rows/s
    r = _result([0.0, 0.5, 1.0], [100, 100, 100], [5, 10, 10])
    assert r.below_floor(rows_per_second=21, rtf=1.0)  # 20 < 21
    assert not r.below_floor(rows_per_second=21, rtf=2.0)  # 20 >= 10.5
    assert not _result([0.0], [100], [5]).below_floor(21)  # one response: no rate to judge
