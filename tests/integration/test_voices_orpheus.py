"""Registered voices on an Orpheus-format repository rendered by `tandem-repo --checkpoint --codec`,
through the real tritonserver and tandem-gateway: the tests' Orpheus-layout checkpoint (a real
checkpoint's files, no `tandem_voices`: tandem-repo writes Orpheus' voices) and real SNAC (the
`snac` package, the 24 kHz config, random weights). A voice is registered from a 16 kHz WAV over
HTTP and a 24 kHz FLAC over gRPC with SNAC's own encoder; its prompt is Orpheus' zero-shot layout;
`tts` equals `tts_mono` token for token; it differs from a built-in voice under one seed; P's prefix
cache serves at least the reference's audio tokens on the second request; a registration that
encodes for seconds does not hold up speech."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from tandem.cli import make_repository
from tandem.gateway.client import StreamResult, TTSClient
from tandem.gateway.errors import ClientCode
from tandem.gateway.voice_client import VoiceClient
from tests.support.gateway_process import gateway_process
from tests.support.helpers import settled_metric, wait_metric
from tests.support.server import TritonProcess
from tests.support.snac_dir import write_snac_dir
from tests.support.text_models import ORPHEUS_VOICES, orpheus_checkpoint
from tests.support.voice_audio import encoded_bytes, http_call, register_http, speech_like, wav_bytes

MODELS = ("tts", "tts_mono")
SPEAK = {"TEXT": "Hey there, a new sentence.", "MAX_TOKENS": 14, "SEED": 11}
TRANSCRIPT = "Hello there, this is how I sound when I read a sentence aloud."


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    work = tmp_path_factory.mktemp("orpheus-voices")
    repo = work / "repo"
    argv = [
        "--out", str(repo),
        "--checkpoint", str(orpheus_checkpoint(work / "ckpt")),
        "--codec", str(write_snac_dir(work / "snac", noise=False)),
        # a 156,940-id head on a shared 2-core CPU: no start-up calibration, no rate admission
        "--set", "decode:tandem.batch.calibrate_steps=0",
        "--set", "decode:tandem.batch.rate_admission=false",
    ]  # fmt: skip
    assert make_repository.main(argv) == 0
    proc = TritonProcess(work / "server")
    proc.repo = repo  # serve what tandem-repo rendered
    proc.start(timeout_s=600)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(orpheus: TritonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_process(orpheus, tmp_path_factory.mktemp("gateway"), MODELS, timeout_s=120) as base:
        yield base


def speak(url: str, model: str, voice: str) -> object:
    with TTSClient(url, model) as c:
        return c.run(None, timeout_s=300, VOICE=voice, **SPEAK)


def test_built_in_voices_are_enforced_for_a_real_checkpoint(orpheus: TritonProcess, gateway: str) -> None:
    for model in MODELS:
        ok = speak(orpheus.url, model, "tara")
        assert ok.error is None, ok.error  # type: ignore[attr-defined]
        bad = speak(orpheus.url, model, "bob")
        assert bad.error_code is ClientCode.INVALID_ARG  # type: ignore[attr-defined]
        assert f"VOICE 'bob' is not one of this model's voices: {', '.join(ORPHEUS_VOICES)}" in bad.error  # type: ignore[attr-defined]
    sdk = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model="tts", input="Hello there.", voice="bob", response_format="wav")
    assert e.value.body["param"] == "voice"  # type: ignore[index]


def test_register_from_16k_wav_over_http(gateway: str) -> None:
    status, body = register_http(gateway, "ana", TRANSCRIPT, wav_bytes(speech_like(2.0, 16000), 16000))
    assert status == 201, body
    assert body["codec"] == "snac" and body["frames"] == 24  # SNAC pads 2 s to 24 frames of 2,048
    assert body["codes"] == 24 * 7


def test_registration_does_not_hold_up_speech(orpheus: TritonProcess) -> None:
    done: dict[str, float] = {}
    # 25 s of reference: SNAC's encode then takes several times as long as a short speech request, so
    # the order below says whether registration ran off the engine's loop, on a fast box or a slow one.
    flac = encoded_bytes(speech_like(25.0, 24000, seed=2), 24000)

    def register() -> None:
        with VoiceClient(orpheus.url) as vc:
            got = vc.register("bo", "Another voice reads this one.", flac)
            assert got["frames"] == 293  # 25 s = 600,000 samples, padded to 293 frames of 2,048
        done["register"] = time.monotonic()

    t = threading.Thread(target=register)
    t.start()
    orpheus.wait_for_log("voice 'bo': registering")  # the registrar took it: decoding or encoding now
    r = speak(orpheus.url, "tts", "tara")
    done["speech"] = time.monotonic()
    t.join(300)
    assert r.error is None, r.error  # type: ignore[attr-defined]
    assert "register" in done and done["speech"] < done["register"], done


def _is_the_codecs_speech(orpheus: TritonProcess, model: str, r: StreamResult) -> None:
    """`r`'s audio is SNAC's at its 24 kHz, every whole frame of the rows it got and no more (7 rows,
    2,048 samples a frame), and it sounds."""
    with TTSClient(orpheus.url, model) as c:
        p = c.model_parameters()
    rate, rows_per_s = int(p["sample_rate"]), float(p["rows_per_second"])
    assert rate == 24000 and rows_per_s == 24000 / 2048 * 7, p
    assert r.rows is not None and r.audio is not None and r.audio.dtype == np.float32
    frames = r.rows.shape[0] // 7
    assert frames > 0 and r.audio.shape == (frames * 2048,)
    assert r.audio.size / rate == pytest.approx(frames * 7 / rows_per_s)  # seconds the rows stand for
    assert np.isfinite(r.audio).all() and 0 < np.abs(r.audio).max() <= 1.0


def test_speak_with_the_voice(orpheus: TritonProcess) -> None:
    hits = "tandem_prefix_cache_hit_tokens_total"
    first = {m: speak(orpheus.url, m, "ana") for m in MODELS}
    for model, r in first.items():
        assert r.error is None and r.rows is not None and r.rows.shape[0] > 0, r.error  # type: ignore[attr-defined]
        _is_the_codecs_speech(orpheus, model, r)
    np.testing.assert_array_equal(first["tts"].rows, first["tts_mono"].rows)  # type: ignore[attr-defined]
    before = settled_metric(orpheus.metrics_url, hits, model="prefill")  # the first requests' hits in
    second = speak(orpheus.url, "tts", "ana")
    # at least the reference's audio tokens came from the cache (published on the worker's next beat)
    wait_metric(orpheus.metrics_url, hits, lambda v: v - before >= 24 * 7, model="prefill")
    np.testing.assert_array_equal(second.rows, first["tts"].rows)  # type: ignore[attr-defined]
    builtin = speak(orpheus.url, "tts", "tara")
    assert not np.array_equal(builtin.rows, first["tts"].rows)  # type: ignore[attr-defined]
    other = speak(orpheus.url, "tts", "bo")
    assert other.error is None and not np.array_equal(other.rows, first["tts"].rows)  # type: ignore[attr-defined]


def test_list_and_delete(orpheus: TritonProcess, gateway: str) -> None:
    status, body = http_call("GET", f"{gateway}/v1/voices")
    assert status == 200
    assert [(v["id"], v["builtin"]) for v in body["data"]] == [
        *((v, True) for v in ORPHEUS_VOICES),
        ("ana", False),
        ("bo", False),
    ]
    assert http_call("DELETE", f"{gateway}/v1/voices/ana")[0] == 200
    gone = speak(orpheus.url, "tts_mono", "ana")
    assert gone.error_code is ClientCode.INVALID_ARG and "VOICE 'ana' is not one" in gone.error  # type: ignore[attr-defined]
