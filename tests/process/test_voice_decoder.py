"""A reference's decoding in its own child process (`backend/voices/decoder_process.py`): files of
8, 16 and 64 channels (WAV) and 7.1 (FLAC, whose format stops at 8) are mixed to mono or refused
with a clear error, never a crash; a child that crashes or hangs is one refused registration; and
the PyAV conversion the decoder no longer uses (planar float of 8+ channels) still kills a process,
which is why decoding is isolated at all."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from tandem.backend.errors import InvalidInput
from tandem.backend.voices.audio import MAX_CHANNELS
from tandem.backend.voices.decoder_process import decode_isolated
from tests.support.voice_audio import flac_layout, wav_channels

RATE = 16000


@pytest.mark.parametrize(
    "data",
    [wav_channels(1), wav_channels(2), wav_channels(7), wav_channels(8), flac_layout("7.1")],
    ids=["wav-1", "wav-2", "wav-7", "wav-8", "flac-7.1"],
)
def test_up_to_eight_channels_mix_to_the_mono_signal(data: bytes) -> None:
    ref = decode_isolated(data, 24000, 1.0, 30.0)
    mono = decode_isolated(wav_channels(1), 24000, 1.0, 30.0)
    assert ref.sample_rate == 24000 and ref.source_rate == RATE and ref.duration_s == pytest.approx(2.0)
    np.testing.assert_allclose(ref.pcm, mono.pcm, atol=1e-6)  # identical channels: their mean is one


@pytest.mark.parametrize("channels", [9, 16, 64])
def test_more_than_eight_channels_are_refused(channels: int) -> None:
    with pytest.raises(
        InvalidInput, match=f"AUDIO has {channels} channels; a reference has 1 to {MAX_CHANNELS}"
    ):
        decode_isolated(wav_channels(channels), 24000, 1.0, 30.0)


def test_a_decoder_that_crashes_is_one_refused_file() -> None:
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    with pytest.raises(
        InvalidInput, match=r"AUDIO crashed the audio decoder \(SIGSEGV\); nothing was stored"
    ):
        decode_isolated(wav_channels(1), 24000, 1.0, 30.0, command=crash)
    assert decode_isolated(wav_channels(1), 24000, 1.0, 30.0).duration_s == pytest.approx(2.0)  # and on


def test_a_decoder_that_hangs_is_killed_at_its_timeout() -> None:
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    with pytest.raises(InvalidInput, match="AUDIO took longer than 1 s to decode"):
        decode_isolated(wav_channels(1), 24000, 1.0, 30.0, timeout_s=1.0, command=hang)
    assert time.monotonic() - t0 < 10.0


def test_planar_frames_of_eight_channels_still_crash_pyav() -> None:
    """The finding: PyAV reports 9 planes for a planar frame of 8+ channels and `to_ndarray` reads
    past it. Should this start passing, PyAV fixed it (the isolation stays: FFmpeg is native code)."""
    probe = "import av; av.AudioFrame(format='fltp', layout='7.1', samples=1024).to_ndarray()"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120, check=False)
    assert done.returncode < 0, done
