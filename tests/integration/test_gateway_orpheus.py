"""tandem-gateway serving an Orpheus-format repository through the real tritonserver, with the
`openai` SDK as the client: text and an Orpheus voice in, SNAC's 24 kHz audio out as WAV (whole and
streamed), PCM and SSE, every byte the audio a direct gRPC request of the same text gets, and the
model's refusals as OpenAI errors naming the field.

The repository is what `tandem-repo --checkpoint --codec` renders (the family detected from the
checkpoint) for:
- an LM in Orpheus' real formats (`tests/support/text_models.orpheus_checkpoint`: config.json with
  Orpheus' voices, model.safetensors, a Llama-3-style tokenizer.json, generation_config.json), small
  and random, with two edits: generation_config.json's temperature 0 (greedy, so the gateway's audio
  can be compared with a direct request's) and the audio ids' embeddings (tied: the head too) scaled
  up, so a greedy stream never picks end-of-speech and always runs to its length: `ROWS` rows, the
  model's default (`tandem.limits.default_new_rows`, set with `--set`), which an HTTP request gets
  since OpenAI's body has no length field;
- SNAC from the `snac` package with a generated small config: the 24 kHz clock and Orpheus' frame
  (7 codes, 2,048 samples, 4,096-code books), 0.3 M parameters instead of 19.5 M so a 2-core CPU
  decodes it at once; noise off.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.backend.codec.base import CodecSpec
from tandem.backend.codec.snac import SNAC_24KHZ, snac_spec
from tandem.backend.generation.orpheus_ids import AUDIO_BASE as ORPHEUS_AUDIO_BASE
from tandem.backend.generation.orpheus_ids import CODES_PER_SLOT as ORPHEUS_CODES
from tandem.backend.generation.orpheus_ids import SLOTS as ORPHEUS_SLOTS
from tandem.cli import make_repository
from tandem.gateway.audio import pcm16
from tandem.gateway.client import StreamResult, TTSClient
from tests.support.gateway_process import gateway_process, http_get
from tests.support.server import TritonProcess
from tests.support.text_models import ORPHEUS_VOICES, orpheus_checkpoint

MODELS = ("tts", "tts_mono")
ROWS = 21  # 3 frames: the first response's 2 frames (1 sounds), then the rest
TEXT = "Hey there, it's Tara."
VOICE = "tara"
SMALL_SNAC = {**SNAC_24KHZ, "encoder_dim": 8, "decoder_dim": 32, "noise": False}


def _greedy_audio_lm(path: Path) -> Path:
    ckpt = orpheus_checkpoint(path, voices=True)
    weights = ckpt / "model.safetensors"
    tensors = load_file(str(weights))
    audio = slice(ORPHEUS_AUDIO_BASE, ORPHEUS_AUDIO_BASE + ORPHEUS_SLOTS * ORPHEUS_CODES)
    tensors["model.embed_tokens.weight"][audio] *= 50.0  # audio logits ~8 sigma above end-of-speech's
    save_file(tensors, str(weights), metadata={"format": "pt"})
    generation = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.0}))
    return ckpt


def _small_snac(path: Path) -> Path:
    from snac import SNAC

    path.mkdir()
    torch.manual_seed(0)
    (path / "config.json").write_text(json.dumps(SMALL_SNAC))
    torch.save(SNAC(**SMALL_SNAC).state_dict(), path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="module")
def snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _small_snac(tmp_path_factory.mktemp("snac") / "snac")


@pytest.fixture(scope="module")
def spec(snac_dir: Path) -> CodecSpec:
    return snac_spec(snac_dir, "orpheus", 2, 1, ORPHEUS_SLOTS)


@pytest.fixture(scope="module")
def orpheus(tmp_path_factory: pytest.TempPathFactory, snac_dir: Path) -> Iterator[TritonProcess]:
    work = tmp_path_factory.mktemp("orpheus-gateway")
    repo = work / "repo"
    settings = [
        f"{m}:tandem.limits.default_new_rows={ROWS}" for m in ("prefill", "tts_mono")
    ] + [  # a 156,940-id head on a shared 2-core CPU: no start-up calibration, no rate admission
        "decode:tandem.batch.calibrate_steps=0",
        "decode:tandem.batch.rate_admission=false",
    ]
    argv = [
        "--out",
        str(repo),
        "--checkpoint",
        str(_greedy_audio_lm(work / "ckpt")),
        "--codec",
        str(snac_dir),
    ]
    assert make_repository.main(argv + [a for s in settings for a in ("--set", s)]) == 0
    proc = TritonProcess(work / "server")
    proc.repo = repo  # serve what tandem-repo rendered
    proc.start(timeout_s=300)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gateway(orpheus: TritonProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with gateway_process(orpheus, tmp_path_factory.mktemp("gateway"), MODELS) as base:
        yield base


@pytest.fixture
def sdk(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def direct(orpheus: TritonProcess) -> dict[str, StreamResult]:
    """Each model's stream for TEXT/VOICE over gRPC, no MAX_TOKENS: what the gateway must relay."""
    out = {}
    for model in MODELS:
        with TTSClient(orpheus.url, model) as c:
            out[model] = c.run(None, timeout_s=120, TEXT=TEXT, VOICE=VOICE)
        assert out[model].error is None, out[model].error
    return out


def _expected(direct: StreamResult, spec: CodecSpec) -> bytes:
    assert (spec.sample_rate, spec.samples_per_frame, spec.rows_per_frame) == (24000, 2048, 7)
    assert direct.rows is not None and direct.rows.shape == (ROWS, 1)
    assert direct.audio is not None and direct.audio.shape == (ROWS // 7 * spec.samples_per_frame,)
    return pcm16(direct.audio)


def test_models_and_health(sdk, gateway):
    assert {m.id for m in sdk.models.list()} == set(MODELS)
    assert sdk.models.retrieve("tts").id == "tts"
    assert http_get(f"{gateway}/health") == (200, {"status": "ok", "reasons": []})


@pytest.mark.parametrize("model", MODELS)
def test_wav_is_the_streams_audio_at_24_khz(sdk, direct, spec, model):
    resp = sdk.audio.speech.create(model=model, input=TEXT, voice=VOICE, response_format="wav")
    headers = resp.response.headers
    assert headers["content-type"] == "audio/wav" and headers["x-sample-rate"] == "24000"
    body = resp.content
    with wave.open(io.BytesIO(body)) as w:  # answered whole: the header's sizes are real
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == 3 * 2048
        samples = w.readframes(w.getnframes())
    expected = _expected(direct[model], spec)
    assert len(samples) == 2 * 3 * 2048 and len(body) == 44 + len(samples)
    assert samples == expected


def test_wav_streams_response_by_response(sdk, direct, spec):
    with sdk.audio.speech.with_streaming_response.create(
        model="tts", input=TEXT, voice=VOICE, response_format="wav", stream_format="audio"
    ) as resp:
        assert int(resp.headers["x-tandem-stream-id"]) > 0
        chunks = [c for c in resp.iter_bytes() if c]
    assert direct["tts"].response_rows == [14, 7]  # two responses, each a chunk of its own
    assert len(chunks) >= 2 and chunks[0][:4] == b"RIFF"
    body = b"".join(chunks)
    assert body[22:28] == b"\x01\x00\xc0\x5d\x00\x00"  # mono, 24,000 Hz
    assert body[44:] == _expected(direct["tts"], spec)


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_pcm_and_its_sse_events(sdk, direct, spec, stream_format):
    with sdk.audio.speech.with_streaming_response.create(
        model="tts_mono", input=TEXT, voice=VOICE, response_format="pcm", stream_format=stream_format
    ) as resp:
        assert resp.headers["x-sample-rate"] == "24000"
        body = b"".join(resp.iter_bytes())
    expected = _expected(direct["tts_mono"], spec)
    if stream_format == "audio":
        assert body == expected
        return
    events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e.startswith("data: ")]
    done = events[-1]  # usage's input is the prompt the front end made of TEXT and VOICE
    assert done["type"] == "speech.audio.done" and done["usage"]["output_tokens"] == ROWS, done
    assert done["usage"]["total_tokens"] == done["usage"]["input_tokens"] + ROWS > ROWS, done
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == expected


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(
    ("voice", "text", "param", "needle"),
    [
        (  # "alloy" is an alias of a built-in voice (gateway/aliases.py); a name that is neither:
            "nobody",
            TEXT,
            "voice",
            "VOICE 'nobody' is not one of this model's voices: " + ", ".join(ORPHEUS_VOICES),
        ),
        (VOICE, "", "input", "input is empty"),
    ],
    ids=["unknown-voice", "empty-input"],
)
def test_refusals_are_openai_errors_naming_the_field(sdk, model, voice, text, param, needle):
    with pytest.raises(openai.BadRequestError) as e:
        sdk.audio.speech.create(model=model, input=text, voice=voice, response_format="wav")
    assert (e.value.status_code, e.value.code, e.value.param) == (400, "INVALID_ARG", param)
    assert e.value.type == "invalid_request_error"
    message = e.value.body["message"]  # type: ignore[index]
    assert message == f"[INVALID_ARG] {needle}", message
