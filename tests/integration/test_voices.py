"""Registered voices on the checked-in repository (tiny model, byte tokenizer, the reference codec
and its encoder) through the real tritonserver and tandem-gateway: register over HTTP (16 kHz WAV)
and gRPC (24 kHz FLAC), list, speak with it over HTTP and gRPC (`tts` equals `tts_mono` token for
token; other audio than a built-in voice under one seed), P's prefix cache serves the reference's
rows on the second request, the voice survives a restart of the server and the gateway, delete,
and every bad input gets its stated status naming the field. The Orpheus layout with real SNAC:
`test_voices_orpheus.py`."""

from __future__ import annotations

import contextlib
import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from tandem.gateway.client import TTSClient
from tandem.gateway.errors import ClientCode
from tandem.gateway.voice_client import VoiceClient, VoiceError
from tests.support.gateway_process import gateway_process
from tests.support.helpers import metric_value, metrics_text, wait_metric
from tests.support.server import TritonProcess
from tests.support.voice_audio import (
    encoded_bytes,
    flac_layout,
    http_call,
    multipart,
    register_http,
    speech_like,
    wav_bytes,
    wav_channels,
)

MAX_FILE = 1_000_000  # tandem.voices.max_file_bytes here, so an over-size file stays cheap
TRANSCRIPT = "Hello there, this is how I sound when I read a sentence aloud."
BUILTIN = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
SPEAK = {"TEXT": "A new sentence.", "MAX_TOKENS": 12, "SEED": 7, "TEMPERATURE": 1.0}


class Unit:
    """The server and gateway of this module, restartable (same ports, same voice store)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        overrides = {"voices": {"tandem.voices.max_file_bytes": str(MAX_FILE)}}
        self.server = TritonProcess(work / "server", overrides)
        self._gateway = contextlib.ExitStack()
        self.base = ""

    def start(self) -> Unit:
        self.server.start(timeout_s=600)
        self.base = self._gateway.enter_context(gateway_process(self.server, self.work, timeout_s=120))
        return self

    def stop(self) -> None:
        self._gateway.close()
        self.server.stop()


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unit]:
    u = Unit(tmp_path_factory.mktemp("voices")).start()
    yield u
    u.stop()


def speak(url: str, model: str, voice: str, **extra: object) -> object:
    with TTSClient(url, model) as c:
        return c.run(None, VOICE=voice, **{**SPEAK, **extra})


def hit_tokens(unit: Unit, model: str) -> float:
    return metric_value(
        metrics_text(unit.server.metrics_url), "tandem_prefix_cache_hit_tokens_total", model=model
    )


def test_register_over_http_and_grpc_and_list(unit: Unit) -> None:
    status, body = register_http(unit.base, "ana", TRANSCRIPT, wav_bytes(speech_like(3.0, 16000), 16000))
    assert status == 201, body
    assert body["id"] == "ana" and body["object"] == "voice" and body["builtin"] is False
    assert body["codec"] == "reference" and body["duration_s"] == pytest.approx(3.0, abs=0.01)
    assert body["frames"] == 63  # 3 s at the reference codec's 21 rows/s
    with VoiceClient(unit.server.url) as vc:
        flac = encoded_bytes(speech_like(2.0, 24000, seed=1), 24000)
        got = vc.register("bo_b-2", "Another voice reads this.", flac)
        assert got["id"] == "bo_b-2" and got["frames"] == 42
        listed = {v["id"]: v["builtin"] for v in vc.list()}
    assert listed == {**dict.fromkeys(BUILTIN, True), "ana": False, "bo_b-2": False}
    status, body = http_call("GET", f"{unit.base}/v1/voices")
    assert status == 200 and body["object"] == "list"
    assert [(v["id"], v["builtin"]) for v in body["data"]] == [
        *((b, True) for b in BUILTIN),
        ("ana", False),
        ("bo_b-2", False),
    ]


def test_speak_with_it_over_grpc_and_the_prefix_cache_hits(unit: Unit) -> None:
    frames = 63
    first = {m: speak(unit.server.url, m, "ana") for m in ("tts", "tts_mono")}
    for r in first.values():
        assert r.error is None and r.rows is not None and r.rows.shape[0] == 12  # type: ignore[attr-defined]
    np.testing.assert_array_equal(first["tts"].rows, first["tts_mono"].rows)  # type: ignore[attr-defined]
    mid = {m: hit_tokens(unit, m) for m in ("prefill", "tts_mono")}
    second = speak(unit.server.url, "tts", "ana")
    mono = speak(unit.server.url, "tts_mono", "ana")
    # The reference's rows came from the cache. A worker's counters reach Triton's metrics on its
    # next heartbeat, published off the reply path, so the scrape waits for them (a bound, not a race).
    for m in ("prefill", "tts_mono"):
        wait_metric(
            unit.server.metrics_url,
            "tandem_prefix_cache_hit_tokens_total",
            lambda v, m=m: v - mid[m] >= frames,
            timeout_s=30,
            model=m,
        )
    np.testing.assert_array_equal(second.rows, first["tts"].rows)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(mono.rows, first["tts"].rows)  # type: ignore[attr-defined]
    builtin = speak(unit.server.url, "tts", "tara")
    assert builtin.error is None and not np.array_equal(builtin.rows, first["tts"].rows)  # type: ignore[attr-defined]
    assert not np.array_equal(builtin.audio, first["tts"].audio)  # type: ignore[attr-defined]


def test_speak_with_it_over_http(unit: Unit) -> None:
    sdk = openai.OpenAI(base_url=f"{unit.base}/v1", api_key="unused", max_retries=0)
    resp = sdk.audio.speech.create(model="tts", input="Hello there.", voice="ana", response_format="pcm")
    assert len(resp.content) > 0 and len(resp.content) % 2 == 0


@pytest.mark.parametrize(
    ("name", "transcript", "file", "status", "param", "needle"),
    [
        ("x1", TRANSCRIPT, b"not a recording at all " * 40, 400, "file", "AUDIO is not an audio file"),
        (
            "x2",
            TRANSCRIPT,
            wav_bytes(speech_like(3.0, 16000), 16000)[:44],
            400,
            "file",
            "AUDIO holds no samples",
        ),
        (
            "x3",
            TRANSCRIPT,
            wav_bytes(speech_like(0.5, 16000), 16000),
            400,
            "file",
            "shortest reference is 1 s",
        ),
        (
            "x4",
            TRANSCRIPT,
            wav_bytes(speech_like(31.0, 8000), 8000),
            400,
            "file",
            "longest reference is 30 s",
        ),
        ("x5", TRANSCRIPT, b"\0" * (MAX_FILE + 1), 400, "file", "file is over the limit of 1000000 bytes"),
        ("x6", TRANSCRIPT, b"\0" * (MAX_FILE + 70_000), 400, "file", "a reference file may be 1000000"),
        ("x7", "   ", wav_bytes(speech_like(2.0, 16000), 16000), 400, "transcript", "transcript is required"),
        ("x8", None, wav_bytes(speech_like(2.0, 16000), 16000), 400, "transcript", "transcript is required"),
        ("x9", TRANSCRIPT, None, 400, "file", "file is required"),
        ("../x", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000), 400, "name", "is not a voice name"),
        ("a" * 65, TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000), 400, "name", "is not a voice name"),
        ("tara", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000), 400, "name", "'tara' is a built-in"),
        ("ana", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000), 409, "name", "already a registered"),
    ],
    ids=[
        "not-audio",
        "unreadable",
        "short",
        "long",
        "big-file",
        "big-body",
        "blank-transcript",
        "no-transcript",
        "no-file",
        "path-name",
        "long-name",
        "builtin-name",
        "same-name",
    ],
)
def test_bad_registrations(unit: Unit, name, transcript, file, status, param, needle) -> None:
    got_status, body = register_http(unit.base, name, transcript, file)
    assert got_status == status, body
    err = body["error"]
    assert err["param"] == param and needle in err["message"], err
    assert err["code"] == ("ALREADY_EXISTS" if status == 409 else "INVALID_ARG")
    names = [v["id"] for v in http_call("GET", f"{unit.base}/v1/voices")[1]["data"]]
    assert not set(names) & {"x1", "x2", "x3", "x4", "x5", "x6", "x7", "x8", "x9"}  # nothing else kept


def test_a_chunked_upload_past_the_file_limit_is_cut_there(unit: Unit) -> None:
    """No Content-Length to check up front: the gateway counts the body as it arrives and answers
    400 `file` at the model's limit plus the form's slack, not at the route's 64 MiB ceiling."""
    body, ctype = multipart({"name": "x10", "transcript": TRANSCRIPT}, b"\0" * (20 * MAX_FILE))
    url = urllib.parse.urlsplit(unit.base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    try:
        chunks = (body[i : i + 65536] for i in range(0, len(body), 65536))
        conn.request("POST", "/v1/voices", body=chunks, headers={"Content-Type": ctype}, encode_chunked=True)
        resp = conn.getresponse()
        status, err = resp.status, json.loads(resp.read())["error"]
    finally:
        conn.close()
    assert status == 400 and err["param"] == "file", err
    assert f"over {MAX_FILE + 64 * 1024} bytes" in err["message"], err
    names = [v["id"] for v in http_call("GET", f"{unit.base}/v1/voices")[1]["data"]]
    assert "x10" not in names


def test_bad_requests_over_grpc(unit: Unit) -> None:
    with VoiceClient(unit.server.url) as vc:
        with pytest.raises(VoiceError, match=r"\[INVALID_ARG\] NAME '\.\./x' is not a voice name") as e:
            vc.register("../x", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000))
        assert e.value.error.code is ClientCode.INVALID_ARG
        with pytest.raises(VoiceError, match=r"\[INVALID_ARG\] TRANSCRIPT is required"):
            vc.register("x", "", wav_bytes(speech_like(2.0, 16000), 16000))
        with pytest.raises(VoiceError, match=r"\[ALREADY_EXISTS\] NAME 'ana'") as e:
            vc.register("ana", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000))
        with pytest.raises(VoiceError, match=r"\[INVALID_ARG\] NAME 'tara' is a built-in voice"):
            vc.delete("tara")
        with pytest.raises(VoiceError, match=r"\[NOT_FOUND\] NAME 'nobody' is not a registered voice"):
            vc.delete("nobody")
    for model in ("tts", "tts_mono"):
        r = speak(unit.server.url, model, "bob")
        assert r.error_code is ClientCode.INVALID_ARG  # type: ignore[attr-defined]
        assert "VOICE 'bob' is not one of this model's voices: tara, leah" in r.error  # type: ignore[attr-defined]


def test_bad_voice_requests_over_http(unit: Unit) -> None:
    status, body = http_call("DELETE", f"{unit.base}/v1/voices/tara")
    assert status == 400 and body["error"]["param"] == "name" and "built-in" in body["error"]["message"]
    status, body = http_call("DELETE", f"{unit.base}/v1/voices/nobody")
    assert status == 404 and body["error"]["code"] == "NOT_FOUND" and body["error"]["param"] == "name"
    sdk = openai.OpenAI(base_url=f"{unit.base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="tts", input="Hello there.", voice="bob")
    assert e.value.body["param"] == "voice" and "tara, leah" in e.value.body["message"]  # type: ignore[index]


def test_uploads_of_many_channels_do_not_take_the_voices_engine_down(unit: Unit) -> None:
    """8+ channels used to segfault the `voices` worker (one 9 KB upload); now up to 8 channels are
    mixed to mono and more are refused naming `file`, on the same worker, which never restarted."""
    text = metrics_text(unit.server.metrics_url)
    restarts = metric_value(text, "tandem_engine_restarts_total", model="voices")
    for name, data in (("ch8", wav_channels(8)), ("fl71", flac_layout("7.1"))):
        status, body = register_http(unit.base, name, TRANSCRIPT, data)
        assert status == 201 and body["duration_s"] == pytest.approx(2.0, abs=0.01), body
    for channels in (16, 64):
        data = wav_channels(
            channels, seconds=0.5, rate=8000
        )  # under the 1 MB limit: the channels are refused first
        status, body = register_http(unit.base, f"ch{channels}", TRANSCRIPT, data)
        assert status == 400 and body["error"]["param"] == "file", body
        assert f"AUDIO has {channels} channels; a reference has 1 to 8" in body["error"]["message"]
    status, body = register_http(unit.base, "TARA", TRANSCRIPT, wav_channels(1))
    assert status == 400 and "'TARA' is a built-in voice" in body["error"]["message"], body
    text = metrics_text(unit.server.metrics_url)
    assert metric_value(text, "tandem_engine_restarts_total", model="voices") == restarts
    assert metric_value(text, "tandem_engine_up", model="voices") == 1.0
    for name in ("ch8", "fl71"):
        assert http_call("DELETE", f"{unit.base}/v1/voices/{name}")[0] == 200


LONG_TEXT = " ".join(f"This is sentence number {i} of a long text, read aloud slowly." for i in range(60))


def _speech_body(base: str, voice: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    body = {"model": "tts", "input": LONG_TEXT, "voice": voice, "response_format": "pcm", "seed": 3}
    conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def test_a_voice_deleted_while_it_speaks_finishes_that_response(unit: Unit) -> None:
    """Deleting through the gateway waits for its sessions: the response speaking with the voice
    is whole (the same length as one before the deletion), new requests are refused at once, and
    the voice is gone from the unit once the response ended."""
    status, body = register_http(unit.base, "gone", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000))
    assert status == 201, body
    conn, resp = _speech_body(unit.base, "gone")
    whole = resp.read()
    conn.close()
    conn, resp = _speech_body(unit.base, "gone")
    head = resp.read(4096)
    status, body = http_call("DELETE", f"{unit.base}/v1/voices/gone")
    assert status == 200 and body["deleted"] is True, body
    sdk = openai.OpenAI(base_url=f"{unit.base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="tts", input="Hello there.", voice="gone")
    assert e.value.body["param"] == "voice" and "deleted" in e.value.body["message"]  # type: ignore[index]
    assert register_http(unit.base, "gone", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000))[0] == 409
    rest = resp.read()
    conn.close()
    assert len(head + rest) == len(whole) > 4096
    deadline = time.monotonic() + 30
    while "gone" in {v["id"] for v in http_call("GET", f"{unit.base}/v1/voices")[1]["data"]}:
        assert time.monotonic() < deadline, "the deferred deletion did not happen"
        time.sleep(0.2)


def test_a_response_cut_by_a_failed_segment_is_not_complete(unit: Unit) -> None:
    """A voice deleted past the gateway (gRPC) fails the response's later segments: the body ends
    without its last chunk, so the client sees it cut, never a clean 200."""
    status, body = register_http(unit.base, "cut", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000))
    assert status == 201, body
    conn, resp = _speech_body(unit.base, "cut")
    resp.read(4096)
    with VoiceClient(unit.server.url) as vc:
        vc.delete("cut")
    with pytest.raises(http.client.IncompleteRead):
        resp.read()
    conn.close()


def test_the_voice_survives_a_restart_then_is_deleted(unit: Unit) -> None:
    before = speak(unit.server.url, "tts", "ana")
    unit.stop()
    unit.start()
    status, body = http_call("GET", f"{unit.base}/v1/voices")
    assert status == 200 and {"ana", "bo_b-2"} <= {v["id"] for v in body["data"]}
    after = speak(unit.server.url, "tts", "ana")
    np.testing.assert_array_equal(after.rows, before.rows)  # type: ignore[attr-defined]
    status, body = http_call("DELETE", f"{unit.base}/v1/voices/ana")
    assert status == 200 and body == {"id": "ana", "object": "voice", "deleted": True}
    assert "ana" not in {v["id"] for v in http_call("GET", f"{unit.base}/v1/voices")[1]["data"]}
    for model in ("tts", "tts_mono"):
        gone = speak(unit.server.url, model, "ana")
        assert gone.error_code is ClientCode.INVALID_ARG and "VOICE 'ana' is not one" in gone.error  # type: ignore[attr-defined]
    sdk = openai.OpenAI(base_url=f"{unit.base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="tts", input="Hello there.", voice="ana")
    assert e.value.body["param"] == "voice"  # type: ignore[index]
