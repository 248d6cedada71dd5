"""tandem-gateway through the real tritonserver: the OpenAI SDK as the HTTP client for everything that
needs no text, and the gateway's own streaming path (its internal request builder, prompt rows) for
the audio framing, the stream's errors and a caller who hangs up.

The checked-in repository's models publish no TEXT input, so over HTTP the gateway refuses text with
a 400; `test_text_streams_over_http` runs once the served `tts` publishes TEXT (the text front end).
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from tandem.cli.tts_client import TTSClient
from tandem.serving.client_errors import ClientCode
from tandem.serving.gateway import Gateway, GatewaySettings, error_response
from tandem.serving.gateway_audio import AudioFormat, Framer, StreamFormat, pcm16, wav_header
from tandem.serving.gateway_stream import GatewayError, StreamRequest, new_stream_id, prompt_inputs
from tests.integration.helpers import TINY_V, TINY_W, metric_value, metrics_text, prompt, wait_metric
from tests.integration.server import TritonProcess, free_port

SAMPLE_RATE = 22050  # published by the checked-in repository


@pytest.fixture(scope="module")
def gateway(server: TritonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tandem-gateway` as its own process in front of the session's server; yields its base URL."""
    port = free_port()
    log = Path(tmp_path_factory.mktemp("gateway")) / "gateway.log"
    cmd = [
        str(Path(sys.executable).parent / "tandem-gateway"),
        f"--triton={server.url}",
        f"--port={port}",
        f"--metrics-url={server.metrics_url}",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as r:
                    if len(json.load(r)["data"]) == 2:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def sdk(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {}
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_models_list_and_retrieve(sdk):
    assert {m.id for m in sdk.models.list()} == {"tts", "tts_mono"}
    assert sdk.models.retrieve("tts_mono").id == "tts_mono"
    with pytest.raises(openai.NotFoundError) as e:
        sdk.models.retrieve("tts-1")
    assert e.value.code == "NOT_FOUND"


def test_health_reflects_the_unit(gateway):
    status, body = _get(f"{gateway}/health")
    assert (status, body) == (200, {"status": "ok", "reasons": []})


def test_health_is_503_with_a_reason_when_the_metrics_cannot_be_read(server):
    async def main() -> tuple[int, dict]:
        gw = Gateway(GatewaySettings(server.url, f"http://127.0.0.1:{free_port()}/metrics"))
        await gw.start()
        try:
            resp = await gw.health()
            return resp.status_code, json.loads(bytes(resp.body))
        finally:
            await gw.stop()

    status, body = asyncio.run(main())
    assert status == 503 and body["status"] == "unavailable"
    assert any("cannot read" in r for r in body["reasons"]), body


@pytest.mark.parametrize(
    ("kwargs", "param", "needle"),
    [
        ({"speed": 1.5}, "speed", "speed = 1.5: only 1.0 is supported"),
        ({"response_format": "mp3"}, "response_format", "'mp3' is not supported: use wav or pcm"),
    ],
)
def test_bad_requests_get_openai_errors_with_400(sdk, kwargs, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="tts", input="Hello there.", voice="tara", **kwargs)
    assert e.value.status_code == 400
    assert e.value.code == "INVALID_ARG" and e.value.param == param
    assert e.value.type == "invalid_request_error"
    message = e.value.body["message"]  # type: ignore[index]
    assert message.startswith("[INVALID_ARG] ") and needle in message, message


def test_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.audio.speech.create(model="tts-1", input="Hello", voice="alloy")
    assert e.value.code == "NOT_FOUND" and e.value.param == "model"
    assert "served: tts, tts_mono" in e.value.body["message"]  # type: ignore[index]


def test_malformed_bodies_are_400_naming_the_field(gateway):
    status, body = _post(f"{gateway}/v1/audio/speech", {"model": "tts", "voice": "tara"})
    assert status == 400 and body["error"]["param"] == "input" and body["error"]["code"] == "INVALID_ARG"
    status, body = _post(
        f"{gateway}/v1/audio/speech", {"model": "tts", "input": "hi", "voice": "tara", "prompt_rows": [[1]]}
    )
    assert status == 400 and body["error"]["param"] == "prompt_rows", body
    status, body = _post(f"{gateway}/v1/audio/speech", {"model": "tts", "input": "x" * 4097, "voice": "v"})
    assert status == 400 and body["error"]["param"] == "input", body


def test_text_streams_over_http(sdk, server):
    import tritonclient.grpc as grpcclient

    inputs = {
        i["name"]
        for i in grpcclient.InferenceServerClient(server.url).get_model_metadata("tts", as_json=True)[
            "inputs"
        ]
    }
    if "TEXT" not in inputs:
        pytest.skip("the served tts publishes no TEXT input (the text front end is not in this repository)")
    with sdk.audio.speech.with_streaming_response.create(
        model="tts", input="Hello there.", voice="tara", response_format="pcm"
    ) as resp:
        assert resp.headers["x-sample-rate"] and int(resp.headers["x-tandem-stream-id"]) > 0
        chunks = [c for c in resp.iter_bytes() if c]
    assert len(chunks) > 1 and sum(len(c) for c in chunks) % 2 == 0


# ---- the gateway's streaming path against the real server, prompt rows in (no HTTP) --------------


async def _collect(server: TritonProcess, req: StreamRequest, framer: Framer) -> list[bytes]:
    gw = Gateway(GatewaySettings(server.url, server.metrics_url))
    await gw.start()
    try:
        resp = await gw.respond(req, framer, time.monotonic())
        assert resp.headers["x-tandem-stream-id"] == str(req.stream_id)
        return [bytes(c) async for c in resp.body_iterator]
    finally:
        await gw.stop()


def _direct_audio(server: TritonProcess, model: str, p: np.ndarray, **params) -> np.ndarray:
    with TTSClient(server.url, model) as c:
        r = c.run(p, **params)
    assert r.error is None and r.audio is not None, r.error
    return r.audio


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_wav_and_pcm_stream_the_same_audio_as_direct_grpc(server, model):
    p, params = prompt(30, seed=5), {"MAX_TOKENS": 60, "TEMPERATURE": 0.0}
    expected = pcm16(_direct_audio(server, model, p, **params))
    for fmt in AudioFormat:
        req = StreamRequest(model, prompt_inputs(p, **params), new_stream_id())
        chunks = asyncio.run(_collect(server, req, Framer(fmt, StreamFormat.AUDIO, SAMPLE_RATE)))
        assert len(chunks) > 2  # streamed response by response (4, 8, 16, 32 rows), not buffered
        body = b"".join(chunks)
        if fmt is AudioFormat.WAV:
            assert body[:44] == wav_header(SAMPLE_RATE) and chunks[0][:4] == b"RIFF"
            body = body[44:]
        assert body == expected


def test_sse_events_carry_the_audio_and_the_row_count(server):
    p, params = prompt(25, seed=6), {"MAX_TOKENS": 40, "TEMPERATURE": 0.0}
    expected = pcm16(_direct_audio(server, "tts", p, **params))
    req = StreamRequest("tts", prompt_inputs(p, **params), new_stream_id())
    body = b"".join(
        asyncio.run(_collect(server, req, Framer(AudioFormat.PCM, StreamFormat.SSE, SAMPLE_RATE)))
    )
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1] == {"type": "speech.audio.done", "usage": {"output_tokens": 40}}
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == expected


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (np.full((10, TINY_W), TINY_V, dtype=np.int64), "outside the vocabulary"),  # tandem's own error
        (np.zeros((10, TINY_W), dtype=np.float32), "data-type is 'fp32'"),  # Triton core's, no code
    ],
)
def test_errors_before_the_first_audio_are_json_with_their_status(server, bad, needle):
    req = StreamRequest("tts", prompt_inputs(bad, MAX_TOKENS=5), new_stream_id())
    with pytest.raises(GatewayError) as e:
        asyncio.run(_collect(server, req, Framer(AudioFormat.WAV, StreamFormat.AUDIO, SAMPLE_RATE)))
    err = e.value.error
    assert err.code is ClientCode.INVALID_ARG and needle in err.detail.lower(), err
    assert "in ensemble" not in err.detail and "request id" not in err.detail
    resp = error_response(err)
    assert resp.status_code == 400 and json.loads(bytes(resp.body))["error"]["code"] == "INVALID_ARG"


def test_a_caller_who_hangs_up_cancels_the_stream(server):
    """tts_mono: Triton 2.51 passes a cancellation into an ensemble only between its steps, so `decode`
    inside `tts` is not told (docs/failure-semantics.md); the monolithic model is, at once."""
    text = metrics_text(server.metrics_url)
    before = metric_value(text, "tandem_streams_total", model="tts_mono", outcome="cancelled")

    async def main() -> int:
        gw = Gateway(GatewaySettings(server.url, server.metrics_url))
        await gw.start()
        try:
            req = StreamRequest(
                "tts_mono", prompt_inputs(prompt(20, seed=7), MAX_TOKENS=2000), new_stream_id()
            )
            resp = await gw.respond(
                req, Framer(AudioFormat.PCM, StreamFormat.AUDIO, SAMPLE_RATE), time.monotonic()
            )
            body = resp.body_iterator
            first = await anext(body)  # type: ignore[call-overload]
            await body.aclose()  # type: ignore[attr-defined]  # what Starlette does when the caller leaves
            return len(first)
        finally:
            await gw.stop()

    assert asyncio.run(main()) > 0
    wait_metric(
        server.metrics_url,
        "tandem_streams_total",
        lambda v: v >= before + 1,
        model="tts_mono",
        outcome="cancelled",
    )
