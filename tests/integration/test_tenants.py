"""API keys and tenants through the real tritonserver and tandem-gateway (`--api-keys FILE`), on the
checked-in repository: a tenant's registered voices are its own (another tenant cannot list, get,
speak with or delete them, and its unknown-voice error does not name them; both may hold the same
name), a missing or wrong key is 401 in OpenAI's shape over HTTP, through the OpenAI SDK and at the
WebSocket's handshake, and a bad upload's error says what is wrong without FFmpeg's errno."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.support.gateway_process import gateway_alone, gateway_process
from tests.support.server import TritonProcess
from tests.support.voice_audio import http_call, register_http, speech_like, wav_bytes

KEY_A, KEY_B = "a-key-0123456789abcdef", "b-key-0123456789abcdef"
TRANSCRIPT = "Hello there, this is how I sound when I read a sentence aloud."
REFERENCE = wav_bytes(speech_like(2.0, 16000, seed=3), 16000)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("tenants")
    keys = work / "keys"
    keys.write_text(f"# tenant key\nacme {KEY_A}\nglobex {KEY_B}\n")
    server = TritonProcess(work / "server")
    server.start(timeout_s=600)
    try:
        with gateway_process(server, work, timeout_s=120, extra_args=[f"--api-keys={keys}"]) as base:
            yield base
    finally:
        server.stop()


def speak(base: str, key: str | None, voice: str) -> tuple[int, bytes]:
    """POST /v1/audio/speech (pcm): (status, body: the audio, or the error's JSON)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    body = json.dumps({"model": "tts", "input": "Hi.", "voice": voice, "response_format": "pcm"}).encode()
    req = urllib.request.Request(f"{base}/v1/audio/speech", body, headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def listed(base: str, key: str) -> set[str]:
    status, body = http_call("GET", f"{base}/v1/voices", key=key)
    assert status == 200, body
    return {v["id"] for v in body["data"] if not v["builtin"]}


def test_a_tenants_voices_are_its_own(gateway: str) -> None:
    assert register_http(gateway, "bob", TRANSCRIPT, REFERENCE, key=KEY_A)[0] == 201
    assert register_http(gateway, "secret_one", TRANSCRIPT, REFERENCE, key=KEY_A)[0] == 201
    assert listed(gateway, KEY_A) == {"bob", "secret_one"}
    assert listed(gateway, KEY_B) == set()
    assert http_call("GET", f"{gateway}/v1/voices/bob", key=KEY_A)[0] == 200
    status, body = http_call("GET", f"{gateway}/v1/voices/bob", key=KEY_B)
    assert (status, body["error"]["param"]) == (404, "name")
    # B cannot speak with A's voice, and the error names only the built-in voices
    status, raw = speak(gateway, KEY_B, "bob")
    error = json.loads(raw)["error"]
    assert (status, error["param"]) == (400, "voice"), error
    assert "VOICE 'bob' is not one of this model's voices: tara, leah" in error["message"]
    assert "secret_one" not in error["message"] and "acme" not in error["message"]
    # B cannot delete it; A still speaks with it
    status, body = http_call("DELETE", f"{gateway}/v1/voices/bob", key=KEY_B)
    assert (status, body["error"]["code"]) == (404, "NOT_FOUND"), body
    status, audio = speak(gateway, KEY_A, "bob")
    assert status == 200 and len(audio) > 0
    # the same name in two tenants is two voices
    assert register_http(gateway, "bob", TRANSCRIPT, REFERENCE, key=KEY_B)[0] == 201
    assert listed(gateway, KEY_B) == {"bob"}
    assert http_call("DELETE", f"{gateway}/v1/voices/bob", key=KEY_A)[0] == 200
    assert listed(gateway, KEY_A) == {"secret_one"} and listed(gateway, KEY_B) == {"bob"}
    assert speak(gateway, KEY_B, "bob")[0] == 200


@pytest.mark.parametrize("key", [None, "not-a-key-0123456789"])
def test_a_missing_or_wrong_key_is_401_in_openais_shape(gateway: str, key: str | None) -> None:
    for method, path in (("GET", "/v1/voices"), ("GET", "/v1/audio/voices"), ("DELETE", "/v1/voices/x")):
        status, body = http_call(method, f"{gateway}{path}", key=key)
        assert status == 401, (path, body)
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
    status, raw = speak(gateway, key, "tara")
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert register_http(gateway, "x", TRANSCRIPT, REFERENCE, key=key)[0] == 401
    if key is not None:  # the SDK itself refuses to send nothing
        sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as e:
            sdk.audio.speech.create(model="tts-1", input="Hi.", voice="alloy")
        assert e.value.code == "invalid_api_key"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = gateway.replace("http://", "ws://") + "/v1/audio/speech/stream-input"
    with pytest.raises(InvalidStatus) as e:
        connect(url, additional_headers=headers).close()
    assert e.value.response.status_code == 401
    assert json.loads(e.value.response.body)["error"]["code"] == "invalid_api_key"
    # what stays open: the model list and the probes
    with urllib.request.urlopen(f"{gateway}/v1/models", timeout=10) as r:
        assert r.status == 200


def test_the_right_key_opens_the_websocket_and_the_sdk(gateway: str) -> None:
    url = gateway.replace("http://", "ws://") + "/v1/audio/speech/stream-input"
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY_B}"}) as ws:
        ws.send(json.dumps({"type": "config", "model": "tts-1", "voice": "alloy", "response_format": "pcm"}))
        assert json.loads(ws.recv())["type"] == "ready"
    sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY_B, max_retries=0)
    audio = sdk.audio.speech.create(model="tts-1", input="Hi.", voice="alloy", response_format="pcm")
    assert len(audio.content) > 0


def test_a_bad_upload_says_what_is_wrong_without_errno(gateway: str) -> None:
    status, body = register_http(gateway, "junk", TRANSCRIPT, b"not a recording at all " * 40, key=KEY_A)
    message = body["error"]["message"]
    assert (status, body["error"]["param"]) == (400, "file"), body
    assert message.startswith("[INVALID_ARG] AUDIO is not an audio file FFmpeg can read (Invalid data")
    assert "Errno" not in message and "<none>" not in message, message
    status, body = register_http(gateway, "a.b", TRANSCRIPT, REFERENCE, key=KEY_A)
    assert (status, body["error"]["param"]) == (400, "name"), body


def test_no_keys_is_open_mode_and_says_so(tmp_path: Path) -> None:
    """Without --api-keys the gateway serves everyone and its log says so at start."""
    with gateway_alone(tmp_path) as gw:
        status, _ = http_call("GET", f"{gw.base}/v1/models")
        assert status == 200
    assert "open development mode: no API keys" in gw.log.read_text()
