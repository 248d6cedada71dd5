"""ReferenceVocoder and ChunkPolicy: chunking must never change the audio, and synthesis must be cheap."""

from __future__ import annotations

import time
import wave
from pathlib import Path

import numpy as np
import pytest

from tandem.backend.codec.config import VocoderConfig
from tandem.backend.codec.reference import ChunkPolicy, ReferenceVocoder, Vocoder, write_wav

CFG = VocoderConfig()  # 22050 Hz, 21 rows/s -> 1050 samples per row


@pytest.fixture
def vocoder() -> Vocoder:
    return ReferenceVocoder(CFG)


def _rows(n: int, seed: int = 0, width: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(n, width), dtype=np.int64)


def test_shape_dtype_range(vocoder: Vocoder) -> None:
    pcm = vocoder.synthesize(_rows(21), 0)
    assert pcm.dtype == np.float32 and pcm.shape == (21 * CFG.samples_per_row,)
    assert np.all(np.abs(pcm) <= 1.0)
    assert 0.05 < float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) < 0.9  # audible, not clipped
    assert vocoder.sample_rate == 22050 and vocoder.samples_per_row == 1050
    assert vocoder.synthesize(_rows(0), 5).shape == (0,)


def test_deterministic(vocoder: Vocoder) -> None:
    rows = _rows(10, seed=3)
    a = vocoder.synthesize(rows, 7)
    b = ReferenceVocoder(CFG).synthesize(rows.copy(), 7)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, vocoder.synthesize(_rows(10, seed=4), 7))  # the ids matter


@pytest.mark.parametrize("first_row", [0, 5, 10**7])  # 10**7 rows: ~5.5 days into a stream
def test_chunked_equals_whole(vocoder: Vocoder, first_row: int) -> None:
    rows = _rows(100, seed=1)
    whole = vocoder.synthesize(rows, first_row)
    splits = [ChunkPolicy().chunk_sizes(100), [1] * 10 + [90], [37, 63], [100]]
    rng = np.random.default_rng(2)
    cuts = np.sort(rng.choice(np.arange(1, 100), size=8, replace=False))
    splits.append(list(np.diff(np.concatenate([[0], cuts, [100]]))))
    for sizes in splits:
        parts, start = [], 0
        for size in sizes:
            parts.append(vocoder.synthesize(rows[start : start + size], first_row + start))
            start += size
        np.testing.assert_allclose(np.concatenate(parts), whole, rtol=0, atol=1e-6, err_msg=str(sizes))


def test_rows_fade_at_edges_so_boundaries_do_not_click(vocoder: Vocoder) -> None:
    spr = CFG.samples_per_row
    pcm = vocoder.synthesize(_rows(21), 0).reshape(21, spr)
    assert np.abs(pcm[:, 0]).max() < 0.01 and np.abs(pcm[:, -1]).max() < 0.01
    assert np.abs(pcm[:, spr // 2]).max() > 0.0


def test_accepts_views_and_other_widths(vocoder: Vocoder) -> None:
    rows = _rows(6, width=8)
    np.testing.assert_array_equal(
        vocoder.synthesize(rows[:, ::2], 3), vocoder.synthesize(rows[:, ::2].copy(), 3)
    )
    wide = vocoder.synthesize(_rows(4, width=16), 0)
    assert wide.shape == (4 * CFG.samples_per_row,) and np.all(np.abs(wide) <= 1.0)


def test_rejects_bad_arguments(vocoder: Vocoder) -> None:
    with pytest.raises(ValueError, match="integer"):
        vocoder.synthesize(np.zeros(4, dtype=np.int64), 0)
    with pytest.raises(ValueError, match="integer"):
        vocoder.synthesize(np.zeros((2, 4), dtype=np.float32), 0)
    with pytest.raises(ValueError, match="first_row must be >= 0"):
        vocoder.synthesize(_rows(2), -1)


def test_far_faster_than_real_time(vocoder: Vocoder) -> None:
    rows = _rows(21)  # one second of audio
    vocoder.synthesize(rows, 0)  # warm numpy's code paths
    start = time.perf_counter()
    vocoder.synthesize(rows, 21)
    assert time.perf_counter() - start < 0.2


def test_chunk_policy_sizes() -> None:
    policy = ChunkPolicy()
    assert [policy.next_size(i) for i in range(6)] == [4, 8, 16, 32, 32, 32]
    assert policy.next_size(10**6) == 32
    assert policy.chunk_sizes(0) == []
    assert policy.chunk_sizes(3) == [3]
    assert policy.chunk_sizes(100) == [4, 8, 16, 32, 32, 8]
    assert ChunkPolicy(first_rows=2, growth=1.5, max_rows=10).chunk_sizes(30) == [2, 3, 4, 7, 10, 4]
    assert ChunkPolicy(first_rows=5, growth=1.0, max_rows=5).chunk_sizes(12) == [5, 5, 2]
    for total in range(200):
        assert sum(policy.chunk_sizes(total)) == total


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"first_rows": 0}, "first_rows must be >= 1"),
        ({"growth": 0.5}, "growth must be a finite number >= 1"),
        ({"growth": float("nan")}, "growth must be a finite number >= 1"),
        ({"first_rows": 8, "max_rows": 4}, r"max_rows \(4\) must be >= first_rows \(8\)"),
    ],
)
def test_chunk_policy_rejects(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ChunkPolicy(**kwargs)


def test_write_wav_round_trip(tmp_path: Path, vocoder: Vocoder) -> None:
    pcm = vocoder.synthesize(_rows(3), 0)
    pcm[:2] = [1.5, -1.5]  # clipped, not wrapped
    path = tmp_path / "out.wav"
    write_wav(path, pcm, CFG.sample_rate)
    with wave.open(str(path), "rb") as f:
        assert (f.getnchannels(), f.getsampwidth(), f.getframerate()) == (1, 2, CFG.sample_rate)
        data = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
    assert data.shape == pcm.shape and data[0] == 32767 and data[1] == -32767
    np.testing.assert_allclose(data[2:] / 32767.0, pcm[2:], atol=1 / 32767)
    with pytest.raises(ValueError, match="1-D mono"):
        write_wav(path, pcm.reshape(3, -1), CFG.sample_rate)
