"""The gateway's audio framing: 16-bit PCM, a streaming WAV header that players and `wave` read, SSE
events as OpenAI names them, and what an error after the first audio becomes."""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np

from tandem.gateway.audio import AudioFormat, Framer, StreamFormat, pcm16, wav_header
from tandem.gateway.errors import ClientCode, ClientError


def test_pcm16_clips_and_scales():
    out = np.frombuffer(pcm16(np.array([0.0, 0.5, 1.0, -1.0, 2.0, -3.0], np.float32)), "<i2")
    assert out.tolist() == [0, 16384, 32767, -32767, 32767, -32767]


def test_a_wav_with_its_length_filled_in_reads_back():
    samples = pcm16(np.sin(np.linspace(0, 20, 1000)).astype(np.float32))
    with wave.open(io.BytesIO(wav_header(22050, len(samples)) + samples)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 22050, 1000)
        assert w.readframes(1000) == samples


def test_the_streaming_header_leaves_both_sizes_unknown():
    h = wav_header(24000)
    assert len(h) == 44 and h[4:8] == b"\xff\xff\xff\xff" and h[40:44] == b"\xff\xff\xff\xff"


def test_audio_framing_puts_the_header_in_the_first_piece_only():
    f = Framer(AudioFormat.WAV, StreamFormat.AUDIO, 22050)
    a, b = np.zeros(10, np.float32), np.ones(5, np.float32)
    assert f.media_type == "audio/wav"
    assert f.piece(a) == wav_header(22050) + pcm16(a)
    assert f.piece(b) == pcm16(b)
    assert f.end(15) == b""
    assert f.error(ClientError(ClientCode.INTERNAL, "x")) is None  # the body is cut instead
    p = Framer(AudioFormat.PCM, StreamFormat.AUDIO, 22050)
    assert p.media_type == "audio/pcm" and p.piece(a) == pcm16(a)


def test_sse_framing():
    f = Framer(AudioFormat.PCM, StreamFormat.SSE, 22050)
    a = np.full(4, 0.25, np.float32)
    assert f.media_type == "text/event-stream"
    event = f.piece(a)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    body = json.loads(event[6:])
    assert body["type"] == "speech.audio.delta" and base64.b64decode(body["audio"]) == pcm16(a)
    usage = {"input_tokens": 12, "output_tokens": 7, "total_tokens": 19}  # OpenAI's usage fields
    assert json.loads(f.end(7, input_tokens=12)[6:]) == {"type": "speech.audio.done", "usage": usage}
    err = f.error(ClientError(ClientCode.INTERNAL, "KV transfer failed"))
    assert err is not None
    assert json.loads(err[6:]) == {
        "type": "error",
        "error": {"message": "[INTERNAL] KV transfer failed", "code": "INTERNAL"},
    }
