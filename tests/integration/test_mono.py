"""tts_mono through the real tritonserver: streaming, determinism, bad input, cancellation, metrics."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tandem.gateway.client import TTSClient, build_inputs
from tests.support.helpers import (
    BAD_PROMPTS,
    SPR,
    TINY_V,
    TINY_W,
    metric_value,
    metrics_text,
    prompt,
    run,
    wait_metric,
)

MODEL = "tts_mono"


def test_streams_tokens_and_audio(server):
    r = run(server.url, MODEL, prompt(40), MAX_TOKENS=20)
    assert r.error is None
    assert r.rows.shape == (20, TINY_W)
    assert r.rows.min() >= 0 and r.rows.max() < TINY_V
    assert r.audio.shape == (20 * SPR,)
    assert np.abs(r.audio).max() <= 1.0 and np.abs(r.audio).max() > 0
    assert r.responses >= 2  # a small first chunk, then larger ones
    for stage in ("entry", "admit", "forward_start", "forward_end", "first_chunk", "last_chunk"):
        assert stage in r.timings


def test_publishes_parameters(server):
    with TTSClient(server.url, MODEL) as c:
        p = c.model_parameters()
    assert (p["row_width"], p["vocab_size"], p["sample_rate"], p["rows_per_second"]) == (
        "4",
        "1024",
        "22050",
        "21",
    )


def test_greedy_and_seeded_are_deterministic(server):
    x = prompt(33, seed=5)
    a = run(server.url, MODEL, x, MAX_TOKENS=12, TEMPERATURE=0.0)
    b = run(server.url, MODEL, x, MAX_TOKENS=12, TEMPERATURE=0.0)
    np.testing.assert_array_equal(a.rows, b.rows)
    s1 = run(server.url, MODEL, x, MAX_TOKENS=12, TEMPERATURE=1.0, SEED=7)
    s2 = run(server.url, MODEL, x, MAX_TOKENS=12, TEMPERATURE=1.0, SEED=7)
    s3 = run(server.url, MODEL, x, MAX_TOKENS=12, TEMPERATURE=1.0, SEED=8)
    np.testing.assert_array_equal(s1.rows, s2.rows)
    assert not np.array_equal(s1.rows, s3.rows)


@pytest.mark.parametrize("case", BAD_PROMPTS, ids=[c[0] for c in BAD_PROMPTS])
def test_bad_input_gets_invalid_arg_and_server_stays_healthy(server, case):
    _, make, needle = case
    x, params = make()
    r = run(server.url, MODEL, x, **params)
    assert r.error is not None and "[INVALID_ARG]" in r.error and needle in r.error, r.error
    ok = run(server.url, MODEL, prompt(8), MAX_TOKENS=3)
    assert ok.error is None and ok.rows.shape == (3, TINY_W)


def test_wrong_width_is_rejected_by_triton(server):
    """PROMPT's width is in the config (dims [-1, W]), so Triton's own shape check refuses it."""
    r = run(server.url, MODEL, prompt(5, width=3))
    assert r.error is not None and "unexpected shape for input 'PROMPT'" in r.error, r.error
    assert "Expected [-1,4], got [5,3]" in r.error, r.error


def test_wrong_dtype_is_rejected_by_triton(server):
    r = run(server.url, MODEL, prompt(5).astype(np.float32))
    assert r.error is not None and "data-type is 'FP32'" in r.error and "expects 'INT64'" in r.error


def test_missing_stream_id_is_rejected(server):
    client = grpcclient.InferenceServerClient(server.url)
    errors = []
    client.start_stream(callback=lambda result=None, error=None: errors.append(error))
    client.async_stream_infer(MODEL, build_inputs(prompt(5)))
    deadline = time.monotonic() + 10
    while not errors and time.monotonic() < deadline:
        time.sleep(0.05)
    client.stop_stream()
    assert errors and errors[0] is not None and "correlation ID" in str(errors[0])


def test_cancellation_frees_pages(server):
    # Idle, every page is available (cached prompt pages count: they are evictable). Gauges publish
    # every ~0.1 s, so wait for the idle value rather than read whatever was last published.
    pool_pages = 4096  # tandem.pool.num_pages of the checked-in tts_mono
    wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v == 0, model=MODEL)
    wait_metric(server.metrics_url, "tandem_free_pages", lambda v: v == pool_pages, model=MODEL)
    c = TTSClient(server.url, MODEL)
    c.send(prompt(300, seed=3), MAX_TOKENS=2000)
    wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v >= 1, model=MODEL)
    c.close(cancel=True)
    wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v == 0, model=MODEL)
    wait_metric(server.metrics_url, "tandem_free_pages", lambda v: v == pool_pages, model=MODEL)


def test_metrics_published(server):
    run(server.url, MODEL, prompt(10), MAX_TOKENS=4)
    text = metrics_text(server.metrics_url)
    assert metric_value(text, "tandem_streams_total", model=MODEL, outcome="finished") >= 1
    assert metric_value(text, "tandem_step_seconds_count", model=MODEL) >= 1
