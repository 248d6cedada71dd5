"""A handoff D sheds before pulling gives P its pages back at once (D tells P: DROP), never the
offer another request with the same ticket still needs. P and D in one process (host path)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from tandem.backend.engines.decode.engine import DecodeEngine, DecodeRequest
from tandem.backend.engines.prefill import PrefillEngine
from tandem.backend.errors import Cancelled, InvalidInput, Overloaded
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.timing import Timings
from tests.support.engines import ListSink, engine_settings, prefill_handoff, started_pd, wait_until

DROP_BOUND_S = 2.0  # shed -> P's pages free, through P's engine loop; the offers' TTL here is 30 s


@pytest.fixture
def pd_one(decoder, tmp_path, monkeypatch):
    """P and D where D decodes one stream at a time and queues one more (rate floor off)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path, max_batch=1, max_queue=1, admission_timeout_s=20.0, rate_admission=False)
    assert s.transfer.ticket_ttl_s >= 30.0
    with started_pd(decoder, s) as pair:
        yield pair


def _running(d: DecodeEngine, p: PrefillEngine, rows: int) -> ListSink:
    h, sink = prefill_handoff(p, 1, rows), ListSink()
    d.submit(DecodeRequest(1, h, sink, Timings(h.timings)))
    assert wait_until(lambda: bool(sink.chunks), 20.0), "the running stream never started"
    return sink


def _released_within(p: PrefillEngine, tid: str, bound_s: float) -> float:
    t0 = time.monotonic()
    assert wait_until(lambda: tid not in p._open, bound_s), f"P still holds {tid}'s pages"
    return time.monotonic() - t0


def test_a_full_queue_and_an_expired_wait_give_p_its_pages_back_at_once(pd_one, monkeypatch):
    p, d = pd_one
    running = _running(d, p, 3000)
    monkeypatch.setattr(d.intake, "admission_timeout_s", 0.5)
    queued, full = prefill_handoff(p, 2, 10), prefill_handoff(p, 3, 10)
    qs, fs = ListSink(), ListSink()
    d.submit(DecodeRequest(2, queued, qs, Timings(queued.timings)))
    with pytest.raises(Overloaded, match="queue is full"):
        d.submit(DecodeRequest(3, full, fs, Timings(full.timings)))
    took = _released_within(p, full.ticket.transfer_id, DROP_BOUND_S)
    assert qs.done.wait(5) and isinstance(qs.error, Overloaded) and "admission wait" in str(qs.error)
    took_wait = _released_within(p, queued.ticket.transfer_id, DROP_BOUND_S)
    print(
        f"\nqueue full: P's pages back in {took * 1e3:.0f} ms; admission wait over: {took_wait * 1e3:.0f} ms"
    )
    assert p.sender.stats().offers_dropped == 2 and d.tickets.dropped == 2 and len(d.tickets) == 0
    assert not running.done.is_set()  # the running stream is untouched


def test_a_handoff_cancelled_or_refused_before_its_pull_is_dropped(pd_one):
    p, d = pd_one
    _running(d, p, 3000)
    h, sink = prefill_handoff(p, 2, 10), ListSink()
    d.submit(DecodeRequest(2, h, sink, Timings(h.timings)))
    sink.cancel = True  # the client went away while the request waited for admission
    assert sink.done.wait(5) and isinstance(sink.error, Cancelled)
    _released_within(p, h.ticket.transfer_id, DROP_BOUND_S)
    bad = prefill_handoff(p, 3, 10)
    bad = replace(bad, first_row=(-1,) * len(bad.first_row))  # a tampered handoff with a live ticket
    with pytest.raises(InvalidInput, match="malformed handoff"):
        d.submit(DecodeRequest(3, bad, ListSink(), Timings()))
    _released_within(p, bad.ticket.transfer_id, DROP_BOUND_S)
    assert p.sender.stats().offers_dropped == 2


def test_shedding_a_replayed_handoff_leaves_the_original_its_offer(pd_one):
    """The same handoff twice: the copy D sheds (queue full) must not drop the offer the queued
    original is about to pull; the original then decodes in full."""
    p, d = pd_one
    running = _running(d, p, 60)
    h = prefill_handoff(p, 2, 6)
    original, replay = ListSink(), ListSink()
    d.submit(DecodeRequest(2, h, original, Timings(h.timings)))  # queued behind the running stream
    with pytest.raises(Overloaded):  # the queue holds one: the replay is shed at once
        d.submit(DecodeRequest(3, h, replay, Timings(h.timings)))
    time.sleep(0.3)
    assert p.sender.stats().offers_dropped == 0 and p.sender.stats().drops_refused == 0
    assert running.done.wait(60) and running.error is None
    assert original.done.wait(30) and original.error is None and original.rows().shape[0] == 6
    assert p.sender.stats().offers_dropped == 0 and d.tickets.dropped == 0
    assert wait_until(lambda: not p._open and len(d.tickets) == 0)


def test_closing_d_drops_the_tickets_still_queued(decoder, tmp_path, monkeypatch):
    """A D that shuts down with handoffs queued tells their P before it closes its receiver."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path, max_batch=1, max_queue=4, admission_timeout_s=20.0, rate_admission=False)
    p = PrefillEngine(decoder, s, RecordingMetrics(), "p0", on_fatal=lambda r: pytest.fail(r))
    d = DecodeEngine(decoder, s, RecordingMetrics())
    p.start()
    d.start()
    try:
        _running(d, p, 3000)
        handoffs = [prefill_handoff(p, 2 + i, 10) for i in range(2)]
        for i, h in enumerate(handoffs):
            d.submit(DecodeRequest(2 + i, h, ListSink(), Timings(h.timings)))
        d.close()
        for h in handoffs:
            _released_within(p, h.ticket.transfer_id, DROP_BOUND_S)
    finally:
        d.close()
        p.close()
