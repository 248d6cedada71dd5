"""The engines without Triton: mono and P+D in one process (real transfer library, host path),
with recording sinks. Checks tokens agree, every page returns, and admission bounds hold."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from tandem.backend.engines.decode.engine import DecodeEngine, DecodeRequest
from tandem.backend.engines.mono import MonoEngine
from tandem.backend.engines.prefill import PrefillEngine, PrefillRequest
from tandem.backend.engines.stream import Chunk, EngineRequest
from tandem.backend.errors import Cancelled, Overloaded
from tandem.backend.generation.sampling import SamplingParams, sample
from tandem.backend.kv.pool import KVPool
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.settings import PoolSettings
from tandem.backend.timing import Timings, waterfall
from tests.support.engines import (
    HandoffBox,
    ListSink,
    engine_settings,
    prefill_handoff,
    prompt_rows,
    started_pd,
    wait_until,
)


@pytest.fixture
def pd(decoder, tmp_path, monkeypatch):
    """A started P and D in this process (one unit, the default test settings), closed afterwards."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with started_pd(decoder, engine_settings(tmp_path)) as pair:
        yield pair


def test_pd_in_process_matches_mono_and_returns_every_page(decoder, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path)
    mono = MonoEngine(decoder, s, RecordingMetrics())
    p = PrefillEngine(decoder, s, RecordingMetrics(), "p0", on_fatal=lambda r: pytest.fail(r))
    d = DecodeEngine(decoder, s, RecordingMetrics())
    for e in (mono, p, d):
        e.start()
    try:
        free_mono, free_d = mono.cache.available_pages, d.pool.num_free_pages
        jobs = [
            (prompt_rows(10 + 13 * i, i), SamplingParams(temperature=0.7 * (i % 2), seed=i), 5 + i)
            for i in range(8)
        ]
        mono_sinks, pd_sinks, pd_timings = [], [], []
        for i, (x, sp, n) in enumerate(jobs):
            ms = ListSink()
            mono.submit(EngineRequest(i + 1, x, sp, n, ms, Timings()))
            mono_sinks.append(ms)
            box = HandoffBox()
            p.submit(PrefillRequest(i + 1, x, sp, n, box, Timings()))
            assert box.done.wait(10) and box.error is None
            assert box.handoff is not None
            ds = ListSink()
            pd_timings.append(Timings(box.handoff.timings))
            d.submit(DecodeRequest(i + 1, box.handoff, ds, pd_timings[-1]))
            pd_sinks.append(ds)
        for a, b, (_, _, n) in zip(mono_sinks, pd_sinks, jobs, strict=True):
            assert a.done.wait(10) and b.done.wait(10)
            assert a.error is None and b.error is None
            np.testing.assert_array_equal(a.rows(), b.rows())
            assert a.rows().shape == (n, 4)
        # D stamps the KV's journey in waterfall order: P's copy, DONE at D's reader, its checksum,
        # the engine thread's pickup (one clock: P and D share this process)
        journey = ("d_admit", "copy_start", "copy_end", "d_done", "d_checksummed", "verified", "first_chunk")
        for t in pd_timings:
            stamps = t.as_dict()
            assert all(stage in stamps for stage in journey), sorted(stamps)
            assert [stamps[x] for x in journey] == sorted(stamps[x] for x in journey), stamps
            names = [name for name, _ in waterfall(stamps)]
            assert all(f"{x}->{y}" in names for x, y in itertools.pairwise(journey)), names
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (
            mono.cache.available_pages != free_mono or d.pool.num_free_pages != free_d or p._open
        ):
            time.sleep(0.02)
        assert mono.cache.available_pages == free_mono
        assert d.pool.num_free_pages == free_d
        assert not p._open  # every offer's source was released
        assert d.receiver.stats().verify_ok == len(jobs)
    finally:
        for e in (mono, p, d):
            e.close()


def test_full_queue_is_unavailable_at_once(decoder, tmp_path):
    mono = MonoEngine(decoder, engine_settings(tmp_path, max_queue=1), RecordingMetrics())  # not started
    mono.submit(EngineRequest(1, prompt_rows(5, 0), SamplingParams(), 3, ListSink(), Timings()))
    with pytest.raises(Overloaded, match="queue is full"):
        mono.submit(EngineRequest(2, prompt_rows(5, 0), SamplingParams(), 3, ListSink(), Timings()))


def test_admission_wait_is_bounded(decoder, tmp_path):
    s = replace(
        engine_settings(tmp_path, admission_timeout_s=0.3), pool=PoolSettings(num_pages=4, page_size=16)
    )
    mono = MonoEngine(decoder, s, RecordingMetrics())
    mono.start()
    try:
        sink = ListSink()  # needs 200 + 100 tokens = 19 pages; the pool has 4
        mono.submit(EngineRequest(1, prompt_rows(200, 0), SamplingParams(), 100, sink, Timings()))
        assert sink.done.wait(5)
        assert isinstance(sink.error, Overloaded) and "admission wait" in str(sink.error)
    finally:
        mono.close()


def test_cancelled_stream_returns_its_pages(decoder, tmp_path):
    mono = MonoEngine(decoder, engine_settings(tmp_path), RecordingMetrics())
    mono.start()
    try:
        free = mono.cache.available_pages
        sink = ListSink()
        mono.submit(EngineRequest(1, prompt_rows(50, 1), SamplingParams(), 2000, sink, Timings()))
        deadline = time.monotonic() + 5
        while not sink.chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        sink.cancel = True
        while mono.cache.available_pages != free and time.monotonic() < deadline + 5:
            time.sleep(0.02)
        assert mono.cache.available_pages == free
        # no final chunk, but one final CANCELLED answer: Triton releases a request only on FINAL
        assert not any(c.final for c in sink.chunks)
        assert isinstance(sink.error, Cancelled), sink.error
    finally:
        mono.close()


def test_d_seeds_its_step_model_before_its_first_admission(pd):
    """D times its own loop at start (backend/engines/decode/calibration.py): the rate floor has a
    fitted model before any stream arrives, and every page of the pool is free again."""
    _, d = pd
    assert d.step_model.ready
    assert d.pool.num_free_pages == d.pool.num_pages
    assert d.metrics.get("tandem_streams_total", outcome="finished") == 0  # its streams are not the service's


def test_a_failed_calibration_leaves_d_serving_on_live_steps(decoder, tmp_path, monkeypatch):
    """Calibration is an optimisation: if it fails with the pool as it was, D logs it, starts with an
    unseeded model (it learns from live steps) and serves."""
    from tandem.backend.engines.decode import calibration

    def broken(batch, plan, steps, seed=0):
        raise RuntimeError("device hiccup")

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "time_steps", broken)
    s = engine_settings(tmp_path)
    p = PrefillEngine(decoder, s, RecordingMetrics(), "p0", on_fatal=lambda r: pytest.fail(r))
    d = DecodeEngine(decoder, s, RecordingMetrics())
    p.start()
    d.start()
    try:
        assert not d.step_model.ready
        handoff, sink = prefill_handoff(p, 1, 5), ListSink()
        d.submit(DecodeRequest(1, handoff, sink, Timings(handoff.timings)))
        assert sink.done.wait(10) and sink.error is None and len(sink.rows()) == 5
    finally:
        d.close()
        p.close()


def test_a_calibration_that_leaves_the_pool_changed_stops_d_from_starting(decoder, tmp_path, monkeypatch):
    """A failure that left pages out (a bug in the calibration, not the device) must not be served
    on: D's start raises, and closing it afterwards is clean."""
    from tandem.backend.engines.decode import calibration

    def leaky(batch, plan, steps, seed=0, grammar=None):
        batch.pool.allocate(1)
        raise RuntimeError("calibration bug")

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "time_steps", leaky)
    d = DecodeEngine(decoder, engine_settings(tmp_path), RecordingMetrics())
    with pytest.raises(RuntimeError, match="calibration bug"):
        d.start()
    d.close()


def test_d_admits_and_pulls_while_its_engine_is_inside_a_step(decoder, tmp_path, monkeypatch):
    """Admission has its own thread: a handoff arriving while D's engine thread is stuck in a (here
    artificially slow) step gets its pages and its PULL before that step ends, and its KV is verified
    by the time the engine looks again. Ordering, not speed: the step takes 1 s, and rate admission
    is off (on a loaded 2-core box the calibrated step model rightly held the second stream until
    the slow step ended, which is the rate floor's policy, not what this checks)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with started_pd(decoder, engine_settings(tmp_path, rate_admission=False)) as (p, d):
        _admits_inside_a_step(p, d, monkeypatch)


def _admits_inside_a_step(p: PrefillEngine, d: DecodeEngine, monkeypatch) -> None:
    first, second = prefill_handoff(p, 1, 40), prefill_handoff(p, 2, 5)
    sink_a, sink_b = ListSink(), ListSink()
    d.submit(DecodeRequest(1, first, sink_a, Timings(first.timings)))
    deadline = time.monotonic() + 10
    while not sink_a.chunks and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sink_a.chunks, "stream A never started"
    slow: dict[str, int] = {}
    advance = d.batch.advance

    def slow_advance():
        if not slow:
            slow["start"] = time.time_ns()
            time.sleep(1.0)
            slow["end"] = time.time_ns()
        return advance()

    monkeypatch.setattr(d.batch, "advance", slow_advance)
    while "start" not in slow and time.monotonic() < deadline:
        time.sleep(0.001)
    timings_b = Timings(second.timings)
    d.submit(DecodeRequest(2, second, sink_b, timings_b))
    assert sink_a.done.wait(10) and sink_b.done.wait(10)
    assert sink_a.error is None and sink_b.error is None
    admitted = timings_b.get("d_admit")
    assert admitted is not None and slow["start"] < admitted < slow["end"], (slow, admitted)
    assert d.receiver.stats().verify_ok == 2


def test_d_fault_while_polling_transfers_fails_both_and_leaks_nothing(decoder, tmp_path, monkeypatch):
    """A fault raised while D handles its waiting transfers (after one of them already joined the
    batch): every client is told, the engine thread survives, no page is freed twice or leaked, and
    D serves the next stream. Rate admission is off: on a loaded 2-core box the calibrated step model
    rightly holds the second stream in admission, which is not what this checks."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    # The gate is in D's engine loop from its first iteration (patched before it starts): no stream
    # can be taken before both transfers are in flight, however late the test's thread runs.
    gate = threading.Event()
    real_take = DecodeEngine._take_admitted

    def take(self: DecodeEngine, block_s: float = 0.0) -> None:
        gate.wait()  # both transfers are in flight before the engine looks at either
        real_take(self, block_s)

    monkeypatch.setattr(DecodeEngine, "_take_admitted", take)
    with started_pd(decoder, engine_settings(tmp_path, rate_admission=False)) as (p, d):
        try:
            _fault_while_polling_transfers(p, d, gate, monkeypatch)
        finally:
            gate.set()  # before D's close, which waits for its engine thread


def _fault_while_polling_transfers(
    p: PrefillEngine, d: DecodeEngine, gate: threading.Event, monkeypatch
) -> None:
    from tandem.transfer import TransferState

    free = d.pool.num_free_pages

    ha, hb = prefill_handoff(p, 1, 200), prefill_handoff(p, 2, 200)
    real_poll, states, fault = d.receiver.poll, {}, []

    def poll(h):
        # Whichever of the two is polled once the other was verified (and so joined) raises: the
        # engine may poll them in either order, and on a loaded box both may verify in one pass.
        other_joined = any(t != h.transfer_id and s is TransferState.VERIFIED for t, s in states.items())
        state = real_poll(h)
        states[h.transfer_id] = state
        if other_joined and not fault:
            fault.append(h.transfer_id)
            raise RuntimeError("injected: device error while handling the second transfer")
        return state

    monkeypatch.setattr(d.receiver, "poll", poll)
    sa, sb = ListSink(), ListSink()
    d.submit(DecodeRequest(1, ha, sa, Timings(ha.timings)))
    d.submit(DecodeRequest(2, hb, sb, Timings(hb.timings)))
    # Both admitted (PULLs sent) before the engine looks at either: a fixed sleep was not enough on
    # a loaded box, where the first stream then ran to its end before the second was polled.
    assert wait_until(lambda: d.admission.admitted.qsize() == 2, 30), "both streams were not admitted"
    gate.set()
    assert sa.done.wait(10) and sb.done.wait(10)
    assert "injected" in str(sa.error) and "injected" in str(sb.error)
    deadline = time.monotonic() + 5
    while (d.pool.num_free_pages != free or d.members.members) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert d.pool.num_free_pages == free and d.members.members == 0 and d.members.admitted_ctx == 0
    sc = ListSink()
    hc = prefill_handoff(p, 3, 5)
    d.submit(DecodeRequest(3, hc, sc, Timings(hc.timings)))
    assert sc.done.wait(10) and sc.error is None and sc.rows().shape[0] == 5


def test_closing_d_tells_waiting_and_running_clients(decoder, tmp_path, monkeypatch):
    """close() while one stream runs and another waits for a copy that P's fault hook holds: both
    clients get "decode is shutting down" at once instead of hanging.

    The state is made, not waited for: the first stream runs before the hold is switched on, so the
    held copy is the second stream's, and it stays held (D's transfer deadline is beyond the test)
    until the test releases it after close. Rate admission is off: on a loaded 2-core box the
    calibrated step model rightly holds the second stream in admission, which is not what this checks."""
    from tandem.backend.settings import FaultSettings
    from tests.support.fault_hooks import HOOK_FILE

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path, rate_admission=False)
    s = replace(s, transfer=replace(s.transfer, deadline_s=60.0))
    control = tmp_path / "faults.json"
    hook = FaultSettings(hook=HOOK_FILE, options=json.dumps({"control_file": str(control)}))
    p = PrefillEngine(decoder, replace(s, faults=hook), RecordingMetrics(), "p0", on_fatal=lambda r: None)
    d = DecodeEngine(decoder, s, RecordingMetrics())
    p.start()
    d.start()
    try:
        sinks = [ListSink(), ListSink()]
        h = prefill_handoff(p, 1, 2000)
        d.submit(DecodeRequest(1, h, sinks[0], Timings(h.timings)))
        assert wait_until(lambda: bool(sinks[0].chunks), 30), "stream 1 never started"
        tmp = tmp_path / "faults.tmp"  # renamed over: the hook never reads a half-written file
        tmp.write_text(json.dumps({"hold": 1}))
        tmp.replace(control)  # every copy from now on waits: stream 2's
        h = prefill_handoff(p, 2, 2000)
        d.submit(DecodeRequest(2, h, sinks[1], Timings(h.timings)))
        assert wait_until(lambda: any(w.stream.stream_id == 2 for w in d.transfers.waiting), 30)
        running = not sinks[0].done.is_set() and not sinks[1].done.is_set()
        assert running, "want one running and one waiting stream"
        t0 = time.monotonic()
        d.close()
        assert time.monotonic() - t0 < 4.0
        for sink in sinks:
            assert sink.done.is_set() and "shutting down" in str(sink.error), sink.error
    finally:
        control.unlink(missing_ok=True)  # releases the held copy, or P's close would wait on it
        d.close()
        p.close()


@pytest.mark.parametrize("direct", [True, False])
def test_failed_transfer_returns_pages_only_with_proof(decoder, tmp_path, monkeypatch, direct):
    """P's copy is still running when D's deadline fails the stream. Direct mode (P writes D's pages):
    the client hears at the deadline, the stream's other pages return at once, its prompt pages only
    when P's ABORT_ACK proves the write over. Region mode: every page returns at once (P writes the
    receive region, which the receiver holds instead)."""
    from tandem.backend.settings import FaultSettings
    from tests.support.fault_hooks import HOOK_FILE

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path)
    s = replace(s, transfer=replace(s.transfer, deadline_s=0.4, abort_retry_s=0.05, direct_write=direct))
    delay = json.dumps({"delay_every": 1, "delay_s": 1.5})  # every copy waits 1.5 s
    slow_p = replace(s, faults=FaultSettings(hook=HOOK_FILE, options=delay))
    p = PrefillEngine(decoder, slow_p, RecordingMetrics(), "p0", on_fatal=lambda r: None)
    d = DecodeEngine(decoder, s, RecordingMetrics())
    assert d.direct is direct
    p.start()
    d.start()
    try:
        free = d.pool.num_free_pages
        h = prefill_handoff(p, 1, 100)  # 30 prompt rows (2 pages) + 100 new rows: 9 pages in all
        sink = ListSink()
        d.submit(DecodeRequest(1, h, sink, Timings(h.timings)))
        assert sink.done.wait(5) and sink.error is not None and "deadline" in str(sink.error), sink.error
        assert wait_until(lambda: not d.transfers.waiting)  # the engine completed the failed handle
        held = d.pool.pages_for(30) if direct else 0
        assert d.pool.num_free_pages == free - held  # time alone frees nothing P may still write
        stats = d.receiver.stats()
        assert stats.quarantined_count == 1 and stats.released_by_ack == 0
        # P's ACK, once its copy returned, frees what it may have written (pages, or the region)
        assert wait_until(lambda: d.receiver.stats().quarantined_count == 0, 5.0)
        assert wait_until(lambda: d.pool.num_free_pages == free)
        assert d.receiver.stats().released_by_ack == 1
    finally:
        d.close()
        p.close()


def test_rate_floor_hold_is_logged_once_with_the_models_numbers(decoder, tmp_path, monkeypatch, caplog):
    """An unreachable floor: the first stream is admitted (an idle D always admits), the second waits
    and then gets UNAVAILABLE; the server log says once why (prediction vs budget), not per retry."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = engine_settings(tmp_path, rate_floor_tok_s=1e6, admission_timeout_s=0.6)
    p = PrefillEngine(decoder, s, RecordingMetrics(), "p0", on_fatal=lambda r: None)
    d = DecodeEngine(decoder, s, RecordingMetrics())
    p.start()
    d.start()
    try:
        first, second = ListSink(), ListSink()
        h1 = prefill_handoff(p, 1, 3000)  # still decoding while the second waits
        d.submit(DecodeRequest(1, h1, first, Timings(h1.timings)))
        assert wait_until(lambda: d.step_model.ready, 10.0)  # it has seen enough steps to refit
        h2 = prefill_handoff(p, 2, 10)
        with caplog.at_level("INFO", logger="tandem"):
            d.submit(DecodeRequest(2, h2, second, Timings(h2.timings)))
            assert second.done.wait(5)
        assert isinstance(second.error, Overloaded), second.error
        holds = [r.getMessage() for r in caplog.records if "rate floor holds admission" in r.getMessage()]
        assert len(holds) == 1, holds
        assert "at 2 streams" in holds[0] and "budget 0.0 ms" in holds[0]
    finally:
        d.close()
        p.close()


def _queued_prefills(p: PrefillEngine, n: int) -> list[HandoffBox]:
    """Submit `n` prompts before P's loop runs, so they are all queued when it first looks."""
    boxes = []
    for i in range(n):
        box = HandoffBox()
        p.submit(
            PrefillRequest(100 + i, prompt_rows(12 + 9 * i, 100 + i), SamplingParams(), 5, box, Timings())
        )
        boxes.append(box)
    return boxes


def test_p_prefills_queued_prompts_in_one_forward_up_to_its_limits(decoder, tmp_path, monkeypatch):
    """Prompts that queued while P was busy go through one forward (at most prefill_batch_max, here
    4: so 6 prompts take two), and each gets the first row a lone prefill gives it."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    metrics = RecordingMetrics()
    p = PrefillEngine(
        decoder, engine_settings(tmp_path, prefill_batch_max=4), metrics, "p0", on_fatal=pytest.fail
    )
    boxes = _queued_prefills(p, 6)
    p.start()
    try:
        for box in boxes:
            assert box.done.wait(10) and box.error is None and box.handoff is not None
        assert metrics.samples[("tandem_prefill_batch", ())] == [4, 2]
        pool = KVPool(decoder.kv_layout(), 64, 16, "cpu")
        for i, box in enumerate(boxes):
            prompt = torch.from_numpy(prompt_rows(12 + 9 * i, 100 + i))
            slots = pool.slots(pool.allocate(pool.pages_for(len(prompt))), len(prompt))
            logits = decoder.prefill(prompt, pool, slots, 0)
            first = sample(logits[None], [SamplingParams()], [len(prompt)])[0]
            assert box.handoff is not None and box.handoff.first_row == tuple(int(x) for x in first)
    finally:
        p.close()


@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("forward", "prefill failed: RuntimeError: broken"),  # the device fails the batch's forward
        ("hand-off", "prefill hand-off failed: RuntimeError: broken"),  # the sender refuses offers
    ],
)
def test_p_failure_answers_and_frees_the_whole_batch(decoder, tmp_path, monkeypatch, where, expected):
    """Every prompt of a failed batch is answered with an error and every page comes back, whether the
    forward failed or the hand-off after it (a review found the latter orphaned)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    p = PrefillEngine(decoder, engine_settings(tmp_path), RecordingMetrics(), "p0", on_fatal=pytest.fail)
    free = p.cache.available_pages

    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    target = (p.decoder, "prefill_many") if where == "forward" else (p.sender, "offer")
    monkeypatch.setattr(*target, broken)
    boxes = _queued_prefills(p, 3)
    p.start()
    try:
        for box in boxes:
            assert box.done.wait(5) and box.handoff is None
            assert expected in str(box.error) or "prefill failed" in str(box.error), box.error
        assert expected in str(boxes[0].error)
        assert wait_until(lambda: p.cache.available_pages == free)
    finally:
        p.close()


class _RaisingSink(ListSink):
    def emit(self, chunk: Chunk) -> None:
        raise RuntimeError("response sender closed")


def test_mono_join_failure_answers_and_frees_the_rest_of_the_batch(decoder, tmp_path):
    mono = MonoEngine(decoder, engine_settings(tmp_path), RecordingMetrics())
    free = mono.cache.available_pages
    sinks = [_RaisingSink(), ListSink(), ListSink()]
    for i, sink in enumerate(sinks):  # queued before the loop starts: one forward takes all three
        mono.submit(EngineRequest(i + 1, prompt_rows(12 + 9 * i, i), SamplingParams(), 1, sink, Timings()))
    mono.start()
    try:
        for sink in sinks[1:]:
            assert sink.done.wait(5) and sink.error is not None
        assert wait_until(lambda: mono.cache.available_pages == free)
    finally:
        mono.close()


def test_d_slot_table_copy_failure_fails_only_that_stream(pd, monkeypatch):
    p, d = pd
    free = d.pool.num_free_pages
    real, calls = d.pool.slots_to_device, []

    def once(arr):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: out of memory")
        return real(arr)

    monkeypatch.setattr(d.pool, "slots_to_device", once)
    sinks = []
    for i in (1, 2):
        h = prefill_handoff(p, i, 6)
        sinks.append(ListSink())
        d.submit(DecodeRequest(i, h, sinks[-1], Timings(h.timings)))
    assert sinks[0].done.wait(5) and "out of memory" in str(sinks[0].error)
    assert sinks[1].done.wait(5) and sinks[1].error is None and sinks[1].rows().shape == (6, 4)
    assert wait_until(lambda: d.pool.num_free_pages == free and d.members.members == 0)
    assert wait_until(lambda: d.receiver.stats().quarantined_bytes == 0)


def test_p_defers_a_prompt_whose_voice_another_batch_member_computes(decoder, tmp_path, monkeypatch):
    """Two queued prompts with the same (uncached) voice prefix: the second waits one forward and then
    hits the prefix cache, instead of computing the same prefix again beside the first."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    metrics = RecordingMetrics()
    p = PrefillEngine(decoder, engine_settings(tmp_path), metrics, "p0", on_fatal=pytest.fail)
    voice = prompt_rows(32, 7)  # two full pages of 16
    boxes = []
    for i in range(2):
        box = HandoffBox()
        prompt = np.concatenate([voice, prompt_rows(5 + i, 50 + i)])
        p.submit(PrefillRequest(200 + i, prompt, SamplingParams(), 5, box, Timings()))
        boxes.append(box)
    p.start()
    try:
        for box in boxes:
            assert box.done.wait(10) and box.error is None
        assert metrics.samples[("tandem_prefill_batch", ())] == [1, 1]
        assert metrics.get("tandem_prefix_cache_hit_tokens_total") == 32
    finally:
        p.close()
