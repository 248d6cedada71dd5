"""The waterfall's stage order, and that `tandem-bench` reports every stage per stream."""

from __future__ import annotations

import itertools

import pytest

from tandem.backend.timing import FIRST_AUDIO_STAGES, STAGES, Timings, waterfall
from tandem.bench.capacity import stream_record
from tandem.gateway.client import StreamResult

# P's copy end to D's pickup, split where D's threads see the transfer (backend/engines/decode/transfers.py)
KV_JOURNEY = ("copy_start", "copy_end", "d_done", "d_checksummed", "verified")


def test_kv_journey_stages_are_consecutive_and_count_to_first_audio() -> None:
    i = STAGES.index("copy_start")
    assert STAGES[i : i + len(KV_JOURNEY)] == KV_JOURNEY
    assert set(KV_JOURNEY) <= set(FIRST_AUDIO_STAGES)
    assert len(set(STAGES)) == len(STAGES)


def test_waterfall_follows_stage_order_and_adds_up() -> None:
    # stamps given out of order, one (d_entry) absent: it is skipped, the rest still add up
    present = [s for s in FIRST_AUDIO_STAGES if s != "d_entry"]
    stamps = {s: 1_000_000 * (i * i) for i, s in enumerate(present)}
    t = Timings(dict(reversed(list(stamps.items()))))
    stages = waterfall(t.as_dict(), FIRST_AUDIO_STAGES)
    assert [name for name, _ in stages] == [f"{a}->{b}" for a, b in itertools.pairwise(present)]
    assert sum(ms for _, ms in stages) == pytest.approx(
        (stamps["client_first_audio"] - stamps["client_send"]) / 1e6
    )


def test_bench_record_has_the_split_transfer_stages() -> None:
    base = 1_700_000_000_000_000_000
    stamps = {s: base + 1_000_000 * i for i, s in enumerate(FIRST_AUDIO_STAGES) if s != "client_first_audio"}
    r = StreamResult(stream_id=1, timings=stamps, sent_ns=stamps["client_send"])
    r.first_response_ns = base + 1_000_000 * FIRST_AUDIO_STAGES.index("client_first_audio")
    rec = stream_record(r, rows_per_second=50.0, floor=0.0)
    wf = rec["waterfall_ms"]
    for a, b in itertools.pairwise(KV_JOURNEY):
        assert wf[f"{a}->{b}"] == pytest.approx(1.0)
    assert "copy_end->verified" not in wf
    assert sum(wf.values()) == pytest.approx(rec["ttfa_ms"])
