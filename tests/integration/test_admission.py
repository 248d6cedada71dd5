"""Rate-floor admission through the real server, made independent of this machine's speed.

D runs with a floor no step can meet (10^6 tok/s) and a 1 s admission wait. Once its step-time
model has seen enough steps, it predicts that any second stream would push the running one below the
floor: that stream waits, and after the bounded wait it gets UNAVAILABLE, while the running stream is
untouched and `tandem_admittable_streams` says 0. An idle D always admits one stream (its model can
only learn from steps it runs), so the next stream after that is served.

The gateway's refusal is made without a prediction: a second D whose batch holds one stream
(`ONE_STREAM`), held by a long stream, so the next one can only wait out its admission wait (the rate
floor decides by a length model's guess of the running stream's remaining rows, which the
`tandem_admittable_streams` gauge does not use: a test that waited for the gauge's 0 once saw the
second stream admitted).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator

import pytest

from tandem.gateway.app import Gateway, GatewaySettings, error_response
from tandem.gateway.audio import AudioFormat, Framer, StreamFormat
from tandem.gateway.client import TTSClient
from tandem.gateway.errors import ClientCode, ClientError
from tandem.gateway.stream import GatewayError, StreamRequest, new_stream_id, prompt_inputs
from tests.support.helpers import TINY_W, prompt, run, wait_metric
from tests.support.server import TritonProcess

OVERRIDES = {
    "decode": {
        "tandem.batch.rate_floor_tok_s": "1000000",
        "tandem.batch.admission_timeout_s": "1",
    }
}

ONE_STREAM = {
    "decode": {
        "tandem.batch.max_batch": "1",
        "tandem.batch.rate_admission": "false",
        "tandem.batch.admission_timeout_s": "1",
    }
}


def _start(work, overrides) -> TritonProcess:
    proc = TritonProcess(work, overrides)
    shutil.rmtree(proc.repo / "tts_mono")  # not used here; saves a stub start
    return proc.start()


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    proc = _start(tmp_path_factory.mktemp("admission"), OVERRIDES)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def one_stream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    proc = _start(tmp_path_factory.mktemp("admission-one-stream"), ONE_STREAM)
    yield proc
    proc.stop()


def test_second_stream_waits_then_unavailable_and_the_first_keeps_going(unit):
    warm = run(unit.url, "tts", prompt(20), MAX_TOKENS=40, TEMPERATURE=0.0)  # 40 steps: the model fits
    assert warm.error is None
    with TTSClient(unit.url, "tts") as ca, TTSClient(unit.url, "tts") as cb:
        a = ca.send(prompt(30, seed=1), MAX_TOKENS=2000, TEMPERATURE=0.0)
        wait_metric(unit.metrics_url, "tandem_inflight_streams", lambda v: v >= 1, model="decode")
        wait_metric(unit.metrics_url, "tandem_admittable_streams", lambda v: v == 0, model="decode")
        b = cb.send(prompt(30, seed=2), MAX_TOKENS=10, TEMPERATURE=0.0)
        (rb,) = cb.wait([b], timeout_s=30)
        assert rb.error is not None and "[UNAVAILABLE]" in rb.error, rb.error
        assert "no capacity within the admission wait of 1 s" in rb.error, rb.error
        (ra,) = ca.wait([a], timeout_s=120)
    assert ra.error is None and ra.rows is not None and ra.rows.shape == (2000, TINY_W)
    assert ra.done_ns > rb.done_ns  # B was refused while A was still streaming
    after = run(unit.url, "tts", prompt(20, seed=3), MAX_TOKENS=5, TEMPERATURE=0.0)
    assert after.error is None and after.rows.shape == (5, TINY_W)  # an idle D admits again
    # The engine's counters reach /metrics with its worker's next heartbeat (tandem.worker.beat_s).
    wait_metric(
        unit.metrics_url, "tandem_streams_total", lambda v: v == 3, 5, model="decode", outcome="finished"
    )


def test_over_capacity_is_503_at_the_gateway(one_stream):
    """The same refusal through the gateway's stream path: UNAVAILABLE before the first audio, so
    the caller gets OpenAI's error JSON with status 503 (the gateway's HTTP routes send exactly
    `error_response`; over HTTP itself a stream needs text, which this repository does not take).
    D holds one stream: while A decodes, B cannot be admitted, however fast or slow the box."""
    unit = one_stream

    async def refused(ca: TTSClient) -> tuple[ClientError, str, int]:
        # The gateway is up before the long stream starts: started after it, on a busy box, its start
        # could outlast the stream, and the second request would then be admitted.
        gw = Gateway(GatewaySettings(unit.url, unit.metrics_url))
        await gw.start()
        try:
            a = ca.send(prompt(30, seed=5), MAX_TOKENS=2000, TEMPERATURE=0.0)
            full = lambda v: v >= 1  # noqa: E731  (A holds D's one place)
            await asyncio.to_thread(
                wait_metric, unit.metrics_url, "tandem_inflight_streams", full, model="decode"
            )
            inputs = prompt_inputs(prompt(30, seed=6), MAX_TOKENS=10, TEMPERATURE=0.0)
            framer = Framer(AudioFormat.WAV, StreamFormat.AUDIO, 22050)
            with pytest.raises(GatewayError) as e:
                await gw.respond(StreamRequest("tts", inputs, new_stream_id()), framer, time.monotonic())
            return e.value.error, a, time.time_ns()
        finally:
            await gw.stop()

    with TTSClient(unit.url, "tts") as ca:
        err, a, refused_ns = asyncio.run(refused(ca))
        (ra,) = ca.wait([a], timeout_s=120)
    assert ra.done_ns > refused_ns  # the refusal came while A was still streaming
    assert err.code is ClientCode.UNAVAILABLE and "no capacity within the admission wait" in err.detail, err
    resp = error_response(err)
    assert resp.status_code == 503
    assert json.loads(bytes(resp.body))["error"]["code"] == "UNAVAILABLE"
    assert ra.error is None and ra.rows is not None and ra.rows.shape == (2000, TINY_W)
