"""`tts` (P -> D -> vocoder ensemble) through the real tritonserver: equivalence with tts_mono,
KV verification at volume, the waterfall, metrics, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tandem.backend.metrics import Engine, zero_series
from tandem.backend.timing import FIRST_AUDIO_STAGES, waterfall
from tandem.gateway.client import TTSClient, next_stream_id, run_concurrent
from tests.support.helpers import (
    BAD_PROMPTS,
    SPR,
    TINY_W,
    call,
    metric_value,
    metrics_text,
    prompt,
    run,
    settled_metric,
    wait_metric,
)
from tests.support.server import TritonProcess


def _jobs(n: int, seed: int) -> list[tuple[np.ndarray, dict]]:
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(n):
        p = prompt(int(rng.integers(3, 260)), seed=seed * 1000 + i)
        kw: dict = {"MAX_TOKENS": int(rng.integers(1, 50)), "SEED": i}
        if i % 2:
            kw["TEMPERATURE"] = 0.0
        else:
            kw["TEMPERATURE"] = 0.8
            kw["TOP_P"] = 0.9 if i % 4 == 0 else None
            kw["TOP_K"] = 40 if i % 3 == 0 else None
        jobs.append((p, kw))
    return jobs


def test_streams_tokens_and_audio(server):
    r = run(server.url, "tts", prompt(50), MAX_TOKENS=25, TEMPERATURE=0.0)
    assert r.error is None
    assert r.rows.shape == (25, TINY_W)
    assert r.audio.shape == (25 * SPR,)
    assert r.responses >= 2


def test_same_contract_and_parameters_as_mono(server):
    with TTSClient(server.url, "tts") as a, TTSClient(server.url, "tts_mono") as b:
        keys = ("row_width", "vocab_size", "sample_rate", "rows_per_second")
        pa, pb = a.model_parameters(), b.model_parameters()
        assert {k: pa[k] for k in keys} == {k: pb[k] for k in keys}


def test_identical_tokens_to_mono_concurrent_mixed_and_prefix_hits(server):
    jobs = _jobs(16, seed=3)
    jobs += [jobs[0], jobs[1], (np.concatenate([jobs[2][0], prompt(7, seed=99)]), jobs[2][1])]  # cache hits
    pd = run_concurrent(server.url, "tts", jobs)
    mono = run_concurrent(server.url, "tts_mono", jobs)
    for i, (a, b) in enumerate(zip(pd, mono, strict=True)):
        assert a.error is None and b.error is None, (i, a.error, b.error)
        np.testing.assert_array_equal(a.rows, b.rows, err_msg=f"job {i}")
        np.testing.assert_array_equal(a.audio, b.audio, err_msg=f"job {i}")


def test_waterfall_stages_in_order_inside_the_clients_window(server):
    """Every stage is stamped by the process that does it (P, D, the vocoder: wall clock, one
    machine), so each must fall in causal order between the client's own send and first audio, and
    the unit's share (`entry` -> `first_audio`) must be inside the client's time to first audio. A
    stage stamped in the wrong place, twice, or on another clock breaks the order or the window."""
    r = run(server.url, "tts", prompt(120, seed=4), MAX_TOKENS=10, TEMPERATURE=0.0)
    stamps = dict(r.timings)
    stamps["client_first_audio"] = r.first_response_ns
    for stage in (
        "entry",
        "forward_start",
        "forward_end",
        "ticket",
        "d_admit",
        "copy_start",
        "copy_end",
        "d_done",
        "d_checksummed",
        "verified",
        "first_chunk",
        "first_audio",
    ):
        assert stage in stamps, stage
    stages = waterfall(stamps, FIRST_AUDIO_STAGES)
    assert all(ms >= 0 for _, ms in stages), stages  # causal order, across three processes' stamps
    assert stamps["client_send"] < stamps["entry"] and stamps["first_audio"] < stamps["client_first_audio"]
    unit_ms = (stamps["first_audio"] - stamps["entry"]) / 1e6
    assert 0 < unit_ms < r.ttfa_ms, (unit_ms, r.ttfa_ms)


@pytest.mark.parametrize("case", BAD_PROMPTS, ids=[c[0] for c in BAD_PROMPTS])
def test_bad_input_rejected_like_mono(server, case):
    _, make, needle = case
    x, params = make()
    a = run(server.url, "tts", x, **params)
    b = run(server.url, "tts_mono", x, **params)
    assert a.error is not None and "[INVALID_ARG]" in a.error and needle in a.error, a.error
    assert b.error is not None and a.error == b.error  # tts_client strips Triton's ensemble prefix


def test_thousand_verified_transfers_no_mismatch(server):
    text = metrics_text(server.metrics_url)
    try:
        ok0 = metric_value(text, "tandem_kv_verifications_total", model="decode", result="ok")
    except KeyError:
        ok0 = 0.0
    n, width = 1000, 16
    done = 0
    for start in range(0, n, width):
        jobs = [
            (prompt(int(8 + (start + i) % 90), seed=start + i), {"MAX_TOKENS": 2, "TEMPERATURE": 0.0})
            for i in range(width)
        ]
        for r in run_concurrent(server.url, "tts", jobs):
            assert r.error is None, r.error
            assert r.rows.shape == (2, TINY_W)
            done += 1
    assert done >= n
    # gauges and verification counts are published every ~0.1 s by D's loop
    wait_metric(
        server.metrics_url,
        "tandem_kv_verifications_total",
        lambda v: v - ok0 >= n,
        model="decode",
        result="ok",
    )
    text = metrics_text(server.metrics_url)
    assert metric_value(text, "tandem_kv_verifications_total", model="decode", result="mismatch") == 0
    assert metric_value(text, "tandem_held_pages", model="decode") == 0


def test_alerted_counters_exist_from_start_up(tmp_path):
    """A fresh server, before any request: every series an alert reads is there, at 0."""
    fresh = TritonProcess(tmp_path).start()
    try:
        text = metrics_text(fresh.metrics_url)
    finally:
        fresh.stop()
    for engine, model in ((Engine.DECODE, "decode"), (Engine.PREFILL, "prefill"), (Engine.MONO, "tts_mono")):
        for name, labels in zero_series(engine):
            assert metric_value(text, name, model=model, **labels) == 0, (name, model, labels)
    assert metric_value(text, "tandem_kv_regions_released_total", model="decode", proof="instance_gone") == 0
    assert metric_value(text, "tandem_streams_total", model="decode", outcome="failed") == 0
    for model in ("prefill", "decode", "tts_mono"):
        assert metric_value(text, "tandem_engine_up", model=model, model_instance=f"{model}_0_0") == 1


def test_metrics_published(server):
    run(server.url, "tts", prompt(30), MAX_TOKENS=5)
    text = metrics_text(server.metrics_url)
    assert metric_value(text, "tandem_transfer_path_info", model="decode", path="host_shm") == 1
    assert metric_value(text, "tandem_transfer_bytes_count", model="decode") >= 1
    assert metric_value(text, "tandem_transfer_latency_seconds_count", model="decode") >= 1
    assert metric_value(text, "tandem_transfers_total", model="decode", outcome="ok") >= 1
    for name in (
        "tandem_inflight_streams",
        "tandem_admittable_streams",
        "tandem_held_pages",
        "tandem_draining",
    ):
        metric_value(text, name, model="decode")


@pytest.mark.parametrize(("model", "publisher"), [("tts", "vocoder"), ("tts_mono", "tts_mono")])
def test_the_unit_observes_each_streams_first_audio_within_the_clients(server, model, publisher):
    """`tandem_first_audio_seconds` (entry -> first audio, on the unit): one sample per stream, and no
    more than the client's own time to first audio, which contains it."""

    def histogram() -> tuple[float, float]:
        text = metrics_text(server.metrics_url)
        try:
            return (
                metric_value(text, "tandem_first_audio_seconds_count", model=publisher),
                metric_value(text, "tandem_first_audio_seconds_sum", model=publisher),
            )
        except KeyError:  # no stream of this model yet: the series does not exist
            return 0.0, 0.0

    engine = "decode" if model == "tts" else model
    # no stream of an earlier test still on the engine, whose first audio would land in the sample
    wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v == 0, model=engine)
    # an observation still on its way (it rides the worker's next beat) would land in the sample
    settled = settled_metric(
        server.metrics_url, "tandem_first_audio_seconds_count", absent=0.0, model=publisher
    )
    count, total = histogram()
    assert count == settled
    r = run(server.url, model, prompt(40, seed=9), MAX_TOKENS=12, TEMPERATURE=0.0)
    assert r.error is None
    wait_metric(
        server.metrics_url, "tandem_first_audio_seconds_count", lambda v: v >= count + 1, model=publisher
    )
    new_count, new_total = histogram()
    unit_s = new_total - total
    assert new_count == count + 1
    assert 0 < unit_s <= r.ttfa_ms / 1e3, (unit_s, r.ttfa_ms)


def _cancel(url: str, value, dtype=np.int64, handoff_text: str | None = None):
    """A request to `decode` with CANCEL (and HANDOFF when given): (responses, error)."""
    inputs = []
    t = grpcclient.InferInput("CANCEL", [1], "INT64" if dtype == np.int64 else "INT32")
    t.set_data_from_numpy(np.array([value], dtype=dtype))
    inputs.append(t)
    if handoff_text is not None:
        h = grpcclient.InferInput("HANDOFF", [1], "BYTES")
        h.set_data_from_numpy(np.array([handoff_text.encode()], dtype=np.object_))
        inputs.append(h)
    return call(url, "decode", inputs, True)


@pytest.mark.parametrize(
    ("value", "handoff_text", "needle"),
    [
        (0, None, "[INVALID_ARG] CANCEL = 0: a stream id is a positive sequence_id"),
        (-5, None, "CANCEL = -5"),
        (7, "{}", "[INVALID_ARG] a request carries one of HANDOFF and CANCEL, not both"),
    ],
)
def test_a_bad_cancel_is_refused_and_harms_nothing(server, value, handoff_text, needle):
    _, err = _cancel(server.url, value, handoff_text=handoff_text)
    assert err is not None and needle in err, err
    assert run(server.url, "tts", prompt(10), MAX_TOKENS=4).error is None


def test_decode_with_neither_handoff_nor_cancel_says_what_it_needs(server):
    _, err = call(server.url, "decode", [], True)
    assert err is not None and "HANDOFF is required (or CANCEL" in err, err


def test_a_cancel_on_decode_ends_that_tts_stream_and_frees_it(server):
    """CANCEL reaches D, which an ensemble's cancellation does not in Triton 2.51: posted before the
    stream starts (still in P, as when a client hangs up early), D drops it when it arrives; another
    stream is untouched; the posting is used up (a later stream with the same id runs whole)."""
    metrics = server.metrics_url
    before = metric_value(metrics_text(metrics), "tandem_streams_total", model="decode", outcome="cancelled")
    sid = next_stream_id()
    out, err = _cancel(server.url, sid)
    assert err is None and len(out) == 1, err  # one acknowledgement
    with TTSClient(server.url, "tts") as victim, TTSClient(server.url, "tts") as bystander:
        k1 = victim.send(prompt(20, seed=3), stream_id=sid, MAX_TOKENS=2000, TEMPERATURE=0.0)
        k2 = bystander.send(prompt(20, seed=4), MAX_TOKENS=30, TEMPERATURE=0.0)
        cancelled = victim.wait([k1], 60)[0]
        other = bystander.wait([k2], 60)[0]
    assert cancelled.error_code is not None and "cancel" in (cancelled.error or "").lower(), cancelled.error
    assert cancelled.rows is None or cancelled.rows.shape[0] < 2000
    assert other.error is None and other.rows.shape == (30, TINY_W)
    wait_metric(
        metrics, "tandem_streams_total", lambda v: v >= before + 1, model="decode", outcome="cancelled"
    )
    wait_metric(metrics, "tandem_inflight_streams", lambda v: v == 0, model="decode")
    with TTSClient(server.url, "tts") as c:
        again = c.wait([c.send(prompt(20, seed=3), stream_id=sid, MAX_TOKENS=12, TEMPERATURE=0.0)], 60)[0]
    assert again.error is None and again.rows.shape == (12, TINY_W)
