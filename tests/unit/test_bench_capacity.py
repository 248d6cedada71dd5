"""`tandem-bench`'s per-stream accounting that needs no server: the responses a stream sent without
audio before the first that sounded (0 expected of a stream sampled as the model's real ones are)."""

from __future__ import annotations

from tandem.bench.capacity import silent_lead, stream_record
from tandem.gateway.client import StreamResult


def _stream(samples: list[int]) -> StreamResult:
    r = StreamResult(stream_id=1, sent_ns=0)
    r.response_ns = [(i + 1) * 70_000_000 for i in range(len(samples))]
    r.response_rows = [14 * 2**i for i in range(len(samples))]
    r.response_samples = samples
    r.first_response_ns = r.response_ns[0] if samples else 0
    return r


def test_responses_without_audio_before_the_first_that_sounds_are_counted() -> None:
    # the grammar-off Orpheus stream measured on the H200: 42 tokens in two responses, then audio
    assert silent_lead(_stream([0, 0, 2048, 4096])) == 2
    assert silent_lead(_stream([2048, 8192, 16384])) == 0  # under the grammar: the first chunk sounds
    assert silent_lead(_stream([0, 0, 0])) == 3  # rows and never a sound
    assert silent_lead(_stream([])) == 0


def test_a_streams_record_carries_its_silent_lead() -> None:
    record = stream_record(_stream([0, 2048, 4096]), rows_per_second=82.03125, floor=164.0625)
    assert record["silent_lead"] == 1
