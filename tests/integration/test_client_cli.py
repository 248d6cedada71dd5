"""`tandem-client` as a user runs it, a process of its own against the real tritonserver: the WAV it
writes, what it prints, and its warning when a stream ran below the rate floor (the unit counts such
streams in `tandem_streams_below_floor_total`; the client says so to the person who ran it)."""

from __future__ import annotations

import subprocess
import sys
import wave

import pytest

from tests.support.helpers import SPR

SAMPLE_RATE = 22050  # published by the checked-in repository


def _client(server, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli.client", "--url", server.url, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_it_writes_the_streams_wav_and_its_waterfall(server, tmp_path):
    out = tmp_path / "out.wav"
    done = _client(server, "--model", "tts", "--rows", "30", "--max-tokens", "40", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "time to first audio" in done.stdout and "waterfall (ms)" in done.stdout
    assert "warning" not in done.stderr  # the tiny model on a CPU runs far above 42 rows/s
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnframes()) == (SAMPLE_RATE, 40 * SPR)


@pytest.mark.parametrize("model", ["tts", "tts_mono"])
def test_it_warns_when_the_stream_ran_below_the_floor(server, tmp_path, model):
    """--rtf 1e-4 asks for 10,000x real time (210,000 rows/s): no stream of this unit reaches it."""
    out = tmp_path / "slow.wav"
    done = _client(server, "--model", model, "--max-tokens", "60", "--rtf", "1e-4", "--out", str(out))
    assert done.returncode == 0, done.stderr  # a warning, not a failure: the audio is written
    assert "warning: the stream ran below the rate floor" in done.stderr
    assert "under 210000.0 (21 rows/s of audio at RTF 0.0001)" in done.stderr
    assert "stalls" in done.stderr and out.stat().st_size == 44 + 2 * 60 * SPR


@pytest.mark.parametrize("rtf", ["0", "-1", "inf", "nan"])
def test_a_bad_rtf_is_refused_before_anything_is_sent(server, tmp_path, rtf):
    done = _client(server, "--rtf", rtf, "--out", str(tmp_path / "x.wav"))
    assert done.returncode == 2 and "--rtf must be a positive number" in done.stderr
    assert not (tmp_path / "x.wav").exists()
