"""tandem-gateway through the real tritonserver on the checked-in repository: the OpenAI SDK as the
HTTP client (text in through the byte tokenizer and plain template, 22,050 Hz audio out, the
refusals), and the gateway's own streaming path (its internal request builder, prompt rows) for
byte-exact framing against direct gRPC, the stream's errors and a caller who hangs up.

The tiny model has no end-of-speech id, so every HTTP request streams the model's default length
(`Limits.default_new_rows`, 256 rows: OpenAI's body has no length field) of 1,050 samples a row.
The Orpheus-format repository (SNAC, 24 kHz, voices): `test_gateway_orpheus.py`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import av
import numpy as np
import openai
import pytest
import tritonclient.grpc as grpcclient

from tandem.backend.codec.config import VocoderConfig
from tandem.backend.settings import Limits
from tandem.gateway.app import Gateway, GatewaySettings, error_response
from tandem.gateway.audio import AudioFormat, Framer, StreamFormat, pcm16, wav_header
from tandem.gateway.client import TTSClient
from tandem.gateway.errors import ClientCode
from tandem.gateway.session import segments
from tandem.gateway.stream import GatewayError, StreamRequest, new_stream_id, prompt_inputs
from tests.support.gateway_process import gateway_process, http_get, http_post
from tests.support.helpers import TINY_V, TINY_W, metric_value, metrics_text, prompt, wait_metric
from tests.support.server import TritonProcess, free_port

SAMPLE_RATE = 22050  # published by the checked-in repository
HTTP_ROWS = Limits().default_new_rows  # an HTTP request's length (the tiny model never stops early)
SAMPLES_PER_ROW = VocoderConfig().samples_per_row


@pytest.fixture(scope="module")
def gateway(server: TritonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`tandem-gateway` as its own process in front of the session's server; yields its base URL."""
    with gateway_process(server, tmp_path_factory.mktemp("gateway")) as base:
        yield base


@pytest.fixture
def sdk(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


def test_models_list_and_retrieve(sdk):
    assert {m.id for m in sdk.models.list()} == {"tts", "tts_mono"}
    assert sdk.models.retrieve("tts_mono").id == "tts_mono"
    with pytest.raises(openai.NotFoundError) as e:
        sdk.models.retrieve("nope")
    assert e.value.code == "NOT_FOUND"


def test_health_reflects_the_unit(gateway):
    status, body = http_get(f"{gateway}/health")
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
        ({"speed": 5.0}, "speed", "speed = 5: outside [0.25, 4]"),  # the rest: test_speech_session.py
        ({"input": " \n"}, "input", "input is empty"),
    ],
)
def test_bad_requests_get_openai_errors_with_400(sdk, kwargs, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(**{"model": "tts", "input": "Hello there.", "voice": "tara", **kwargs})
    assert e.value.status_code == 400
    assert e.value.code == "INVALID_ARG" and e.value.param == param
    assert e.value.type == "invalid_request_error"
    message = e.value.body["message"]  # type: ignore[index]
    assert message.startswith("[INVALID_ARG] ") and needle in message, message


def test_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.audio.speech.create(model="nope", input="Hello", voice="alloy")
    assert e.value.code == "NOT_FOUND" and e.value.param == "model"
    assert "served: tts, tts_mono" in e.value.body["message"]  # type: ignore[index]


def test_malformed_bodies_are_400_naming_the_field(gateway):
    status, body = http_post(f"{gateway}/v1/audio/speech", {"model": "tts", "voice": "tara"})
    assert status == 400 and body["error"]["param"] == "input" and body["error"]["code"] == "INVALID_ARG"
    status, body = http_post(
        f"{gateway}/v1/audio/speech", {"model": "tts", "input": "hi", "voice": "tara", "prompt_rows": [[1]]}
    )
    assert status == 400 and body["error"]["param"] == "prompt_rows", body
    status, body = http_post(
        f"{gateway}/v1/audio/speech", {"model": "tts", "input": "x" * 4097, "voice": "v"}
    )
    assert status == 400 and body["error"]["param"] == "input", body


def test_an_openai_client_as_written_gets_audio(sdk, gateway, server):
    """`model="tts-1", voice="alloy"` as OpenAI's examples have them: the unit itself refuses
    `alloy`; through the gateway tts-1 is the default model (`tts`) and OpenAI's voice names its
    built-in voices in order, alloy tara and ash leah (gateway/aliases.py), which the voice list
    shows."""
    with TTSClient(server.url, "tts") as c:
        refused = c.run(None, TEXT="Hello there.", VOICE="alloy", MAX_TOKENS=4)
    assert refused.error_code is ClientCode.INVALID_ARG and "VOICE 'alloy'" in refused.error
    for model, voice in (("tts-1", "alloy"), ("gpt-4o-mini-tts", "ash"), ("tts-1-hd", "verse")):
        audio = sdk.audio.speech.create(model=model, voice=voice, input="Hello there.", response_format="pcm")
        assert len(audio.content) == 2 * HTTP_ROWS * SAMPLES_PER_ROW
    status, listed = http_get(f"{gateway}/v1/audio/voices")
    builtin = {v["id"]: v["aliases"] for v in listed["data"] if v["builtin"]}
    assert status == 200 and list(builtin)[:2] == ["tara", "leah"], listed
    assert builtin["tara"] == ["alloy", "sage"] and builtin["leah"] == ["ash", "shimmer"]
    assert http_get(f"{gateway}/v1/voices/tara")[1]["aliases"] == builtin["tara"]
    status, body = http_get(f"{gateway}/v1/voices/nobody")
    assert status == 404 and body["error"]["param"] == "name", body


def test_sse_done_carries_openais_usage(sdk, server):
    """`input_tokens` is the prompt the unit made of the input: what `frontend` makes of the same
    text and voice, asked directly."""
    with sdk.audio.speech.with_streaming_response.create(
        model="tts-1", input="Hello there.", voice="alloy", response_format="pcm", stream_format="sse"
    ) as resp:
        body = resp.read()
    done = json.loads(body.decode().strip().split("\n\n")[-1].removeprefix("data: "))
    with grpcclient.InferenceServerClient(server.url) as c:
        inputs = []
        for name, value in (("TEXT", "Hello there."), ("VOICE", "tara")):
            t = grpcclient.InferInput(name, [1], "BYTES")
            t.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
            inputs.append(t)
        prompt_rows = c.infer("frontend", inputs).as_numpy("ROWS").shape[0]
    usage = {"input_tokens": prompt_rows, "output_tokens": HTTP_ROWS, "total_tokens": prompt_rows + HTTP_ROWS}
    assert done == {"type": "speech.audio.done", "usage": usage}


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_text_gives_a_wav_of_its_real_length_at_the_models_rate(sdk, model):
    """No `stream_format`: the whole file, its header's sizes real (wave reads the frame count)."""
    resp = sdk.audio.speech.create(model=model, input="Hello there.", voice="tara", response_format="wav")
    assert resp.response.headers["x-sample-rate"] == str(SAMPLE_RATE)
    assert int(resp.response.headers["content-length"]) == 44 + 2 * HTTP_ROWS * SAMPLES_PER_ROW
    with wave.open(io.BytesIO(resp.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        assert w.getnframes() == HTTP_ROWS * SAMPLES_PER_ROW
        samples = w.readframes(w.getnframes())
    assert len(samples) == 2 * HTTP_ROWS * SAMPLES_PER_ROW
    assert np.frombuffer(samples, "<i2").any()


def test_a_streamed_wav_says_its_length_is_unknown_and_carries_the_same_samples(sdk):
    kw = {"model": "tts", "input": "Hello there.", "voice": "tara", "extra_body": {"seed": 11}}
    whole = sdk.audio.speech.create(response_format="wav", **kw)
    with sdk.audio.speech.with_streaming_response.create(
        response_format="wav", stream_format="audio", **kw
    ) as resp:
        assert "content-length" not in resp.headers  # chunked, as it is produced
        chunks = [c for c in resp.iter_bytes() if c]
    body = b"".join(chunks)
    assert body[:44] == wav_header(SAMPLE_RATE)  # sizes 0xFFFFFFFF: unknown when the first bytes left
    assert body[44:] == whole.content[44:]  # one segment, the same seed: the same samples


def test_the_gateway_metrics_say_which_model(gateway, sdk):
    def requests(status: str, model: str) -> float:
        return metric_value(
            metrics_text(f"{gateway}/metrics"), "tandem_gateway_requests_total", status=status, model=model
        )

    ok, refused = requests("200", "tts_mono"), requests("404", "-")
    sdk.audio.speech.create(model="tts_mono", input="Hi.", voice="tara", response_format="pcm")
    with pytest.raises(openai.NotFoundError):  # a name it does not serve is counted under "-"
        sdk.audio.speech.create(model="nope", input="Hi.", voice="tara", response_format="pcm")
    assert requests("200", "tts_mono") == ok + 1 and requests("404", "-") == refused + 1
    text = metrics_text(f"{gateway}/metrics")
    assert metric_value(text, "tandem_gateway_first_audio_seconds_count", model="tts_mono") >= 1
    assert metric_value(text, "tandem_gateway_streams", model="tts") == 0


def test_text_streams_pcm_and_sse_over_http(sdk):
    with sdk.audio.speech.with_streaming_response.create(
        model="tts", input="Hello there.", voice="tara", response_format="pcm"
    ) as resp:
        assert resp.headers["content-type"] == "audio/pcm" and int(resp.headers["x-tandem-stream-id"]) > 0
        chunks = [c for c in resp.iter_bytes() if c]
    assert len(chunks) > 1 and sum(len(c) for c in chunks) == 2 * HTTP_ROWS * SAMPLES_PER_ROW
    with sdk.audio.speech.with_streaming_response.create(
        model="tts_mono", input="Hello there.", voice="tara", response_format="pcm", stream_format="sse"
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    events = [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: ")]
    done = events[-1]  # usage's input is the prompt the front end made (test_sse_done_carries_openais_usage)
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] == HTTP_ROWS, done
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + HTTP_ROWS > HTTP_ROWS, done
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(events) > 2 and len(audio) == 2 * HTTP_ROWS * SAMPLES_PER_ROW


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
    for fmt in (AudioFormat.WAV, AudioFormat.PCM):  # the encoded formats: test_speech_session.py
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
    usage = {"input_tokens": 25, "output_tokens": 40, "total_tokens": 65}  # the 25-row prompt sent
    assert events[-1] == {"type": "speech.audio.done", "usage": usage}
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


@pytest.mark.parametrize(("model", "engine"), [("tts_mono", "tts_mono"), ("tts", "decode")])
def test_a_caller_who_hangs_up_cancels_the_stream(server, model, engine):
    """tts_mono is told by Triton at once; inside `tts` Triton 2.51 does not pass the cancellation on
    to the decode step, so the gateway sends `decode` a CANCEL with the stream id (cancel_board.py)."""
    text = metrics_text(server.metrics_url)
    before = metric_value(text, "tandem_streams_total", model=engine, outcome="cancelled")

    async def main() -> int:
        gw = Gateway(GatewaySettings(server.url, server.metrics_url))
        await gw.start()
        try:
            while gw.models is None:  # the configs say which models a stream passes (tts: decode)
                await asyncio.sleep(0.05)
            req = StreamRequest(model, prompt_inputs(prompt(20, seed=7), MAX_TOKENS=2000), new_stream_id())
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
        model=engine,
        outcome="cancelled",
    )
    wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v == 0, model=engine)


def test_a_caller_who_hangs_up_on_a_whole_wav_ends_its_session(gateway, server):
    """A wav answered whole is built before any byte goes out: the gateway checks at each piece that
    the caller is still there, and one who left ends the session: counted 499, the segments after
    the hang-up never run, D holds none of its streams (cancelled, or finished within D's 0.5 s
    poll: a tiny-model segment takes a fraction of a second)."""

    def decode_streams() -> float:
        m = metrics_text(server.metrics_url)
        return sum(
            metric_value(m, "tandem_streams_total", model="decode", outcome=o)
            for o in ("finished", "cancelled", "failed")
        )

    text = " ".join(f"Sentence number {i} is here to make the input long." for i in range(60))
    parts = len(segments(text))
    wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v == 0, model="decode")
    before_gw = metric_value(
        metrics_text(f"{gateway}/metrics"), "tandem_gateway_requests_total", status="499", model="tts"
    )
    before_d = decode_streams()
    body = json.dumps({"model": "tts", "input": text, "voice": "tara", "response_format": "wav"}).encode()
    host = urlsplit(gateway)
    with socket.create_connection((host.hostname, host.port), timeout=10) as s:
        s.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v >= 1, model="decode")
    # the socket is closed: the session ends at its next piece
    wait_metric(
        f"{gateway}/metrics",
        "tandem_gateway_requests_total",
        lambda v: v >= before_gw + 1,
        status="499",
        model="tts",
    )
    wait_metric(server.metrics_url, "tandem_inflight_streams", lambda v: v == 0, timeout_s=5, model="decode")
    ran = decode_streams() - before_d
    assert 1 <= ran < parts, (ran, parts)


def test_the_readmes_raw_tritonclient_example_speaks(server):
    """The README's raw `tritonclient` example, run as written against this server."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = readme.split("Raw `tritonclient`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(code.replace("localhost:8001", server.url), scope)
    pcm = np.concatenate(scope["pcm"])
    assert pcm.dtype == np.float32 and pcm.size >= SAMPLES_PER_ROW and np.abs(pcm).max() > 0


def test_headers_say_the_rate_sent_and_a_whole_flac_has_its_length(sdk):
    """Opus is 48 kHz whatever the model's rate, and X-Sample-Rate says so; a flac asked for
    without stream_format is whole: Content-Length, and STREAMINFO's total samples (what FFmpeg
    reads as the duration) is every sample."""
    opus = sdk.audio.speech.create(model="tts", input="Hi.", voice="tara", response_format="opus")
    assert opus.response.headers["x-sample-rate"] == "48000"
    with av.open(io.BytesIO(opus.content)) as c:
        assert c.streams.audio[0].rate == 48000
    flac = sdk.audio.speech.create(model="tts", input="Hi.", voice="tara", response_format="flac")
    assert flac.response.headers["x-sample-rate"] == str(SAMPLE_RATE)
    assert int(flac.response.headers["content-length"]) == len(flac.content)
    with av.open(io.BytesIO(flac.content)) as c:
        stream = c.streams.audio[0]
        assert stream.duration is not None and stream.duration * stream.time_base * SAMPLE_RATE == (
            HTTP_ROWS * SAMPLES_PER_ROW
        )
        assert sum(f.samples for f in c.decode(stream)) == HTTP_ROWS * SAMPLES_PER_ROW
