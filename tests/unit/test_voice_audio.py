"""Reference recordings: decoded from WAV and FLAC at any rate to the codec's rate (soxr), and every
bad upload refused with INVALID_ARG naming AUDIO (what the gateway reports as `file`)."""

from __future__ import annotations

import io
import re
import wave

import numpy as np
import pytest

from tandem.backend.errors import InvalidInput
from tandem.backend.voices.audio import decode_reference
from tests.support.voice_audio import encoded_bytes, speech_like, wav_bytes


@pytest.mark.parametrize("rate", [16000, 24000, 44100])
@pytest.mark.parametrize("container", ["wav", "flac"])
def test_decodes_to_the_codec_rate(rate: int, container: str) -> None:
    pcm = speech_like(2.0, rate)
    data = wav_bytes(pcm, rate) if container == "wav" else encoded_bytes(pcm, rate)
    ref = decode_reference(data, 24000, 1.0, 30.0)
    assert ref.sample_rate == 24000 and ref.source_rate == rate
    assert ref.duration_s == pytest.approx(2.0, abs=1e-3)
    assert ref.pcm.dtype == np.float32 and ref.pcm.shape[0] == pytest.approx(48000, abs=2)
    if rate == 24000:  # no resampling: the 16-bit samples as written
        np.testing.assert_allclose(ref.pcm, pcm, atol=2.0 / 32767)  # 16-bit, /32767 in, /32768 out


def test_stereo_is_mixed_to_mono() -> None:
    pcm = speech_like(1.5, 24000)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(np.rint(np.stack([pcm, pcm], axis=1) * 32767).astype("<i2").tobytes())
    ref = decode_reference(buf.getvalue(), 24000, 1.0, 30.0)
    np.testing.assert_allclose(ref.pcm, pcm, atol=2.0 / 32767)


def _png() -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + bytes(200)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"", "AUDIO is empty"),
        (b"this is a text file, not a recording " * 20, "AUDIO is not an audio file FFmpeg can read"),
        (_png(), "AUDIO holds no audio stream (a png_pipe file)"),
        (wav_bytes(speech_like(0.5, 16000), 16000), "AUDIO is 0.50 s long; the shortest reference is 1 s"),
        (wav_bytes(speech_like(40.0, 8000), 8000), "AUDIO is 40.0 s long; the longest reference is 30 s"),
        (wav_bytes(np.zeros(24000, dtype=np.float32), 24000), "AUDIO is silent"),
        (wav_bytes(speech_like(2.0, 16000), 16000)[:44], "AUDIO holds no samples"),
    ],
    ids=["empty", "text", "png", "short", "long", "silent", "header-only"],
)
def test_bad_uploads_are_refused_naming_audio(data: bytes, needle: str) -> None:
    with pytest.raises(InvalidInput, match=r"^\[INVALID_ARG\] " + re.escape(needle)):
        decode_reference(data, 24000, 1.0, 30.0)
