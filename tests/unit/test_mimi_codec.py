"""Mimi behind the codec seam, from its own package (`transformers.MimiModel`, a tiny saved Mimi with
the real 24 kHz strides and random weights), and CSM's rows as its frames.

Streamed audio (D's windows with their lookback, decoded one chunk at a time, CSM rows in) must
equal Mimi's offline decode of the whole code sequence: >= 80 dB SNR at the default lookback of 8
frames (measured ~100 dB; Mimi is causal, so no lookahead), and audibly off (< 40 dB) with none.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.backend.codec.base import CodecWindow, Framing
from tandem.backend.codec.builder import build_codec, codec_spec, layout
from tandem.backend.codec.csm import CsmLayout
from tandem.backend.codec.mimi import MimiCodec, mimi_spec
from tandem.backend.model.csm import ABSENT
from tandem.backend.settings import parse_settings
from tests.support.csm import CODEBOOKS, MIMI_CODES, write_mimi

transformers = pytest.importorskip("transformers")
FRAMES = 30
SPF = 1920  # 24 kHz / 12.5 frames a second


@pytest.fixture(scope="module")
def mimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mimi")
    write_mimi(path)
    return path


@pytest.fixture(scope="module")
def codec(mimi_dir: Path) -> MimiCodec:
    return MimiCodec(mimi_dir, mimi_spec(mimi_dir, "csm", 8, 0, 1), torch.device("cpu"))


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    return np.random.default_rng(0).integers(0, MIMI_CODES, size=(FRAMES, CODEBOOKS))


def _offline(codec: MimiCodec, frames: np.ndarray) -> np.ndarray:
    return codec.decode([CodecWindow(frames, 0, 0, frames.shape[0])])[0]


def _rows(frames: np.ndarray) -> np.ndarray:
    """Frames as the CSM rows that generate them, then the end frame (not audio)."""
    rows = np.concatenate([frames, np.full((frames.shape[0], 1), ABSENT)], axis=1)
    end = np.concatenate([np.zeros(CODEBOOKS, np.int64), [ABSENT]])[None]
    return np.concatenate([rows, end])


def _streamed(codec: MimiCodec, frames: np.ndarray, lookback: int, sizes: list[int]) -> np.ndarray:
    rows = _rows(frames)
    assert sum(sizes) == rows.shape[0]
    track = Framing(CsmLayout(), lookback, 0).track(CODEBOOKS + 1)
    parts, at = [], 0
    for i, n in enumerate(sizes):
        track.push(rows[at : at + n])
        at += n
        parts.extend(codec.decode([track.window(final=i == len(sizes) - 1)]))
    return np.concatenate(parts)


def _snr_db(ref: np.ndarray, got: np.ndarray) -> float:
    assert got.shape == ref.shape
    ref64, err = ref.astype(np.float64), (got - ref).astype(np.float64)
    return float(10 * np.log10(np.sum(ref64**2) / max(np.sum(err**2), 1e-30)))


def test_offline_decode_is_mimis_own(mimi_dir: Path, codec: MimiCodec, frames: np.ndarray) -> None:
    audio = _offline(codec, frames)
    assert audio.shape == (FRAMES * SPF,) and np.abs(audio).max() > 0
    model = transformers.MimiModel.from_pretrained(str(mimi_dir)).eval()
    with torch.no_grad():
        ref = model.decode(torch.from_numpy(frames.T.copy())[None]).audio_values[0, 0].numpy()
    np.testing.assert_array_equal(audio, ref)


@pytest.mark.parametrize("sizes", [[4] * 7 + [3], [1] * 31, [10, 21]])
def test_streamed_audio_equals_the_offline_decode(
    codec: MimiCodec, frames: np.ndarray, sizes: list[int]
) -> None:
    assert _snr_db(_offline(codec, frames), _streamed(codec, frames, 8, sizes)) >= 80.0


def test_without_lookback_the_stream_is_audibly_off(codec: MimiCodec, frames: np.ndarray) -> None:
    assert _snr_db(_offline(codec, frames), _streamed(codec, frames, 0, [3] * 10 + [1])) < 40.0


def test_one_batched_call_equals_one_call_per_stream(codec: MimiCodec) -> None:
    rng = np.random.default_rng(3)
    windows = [
        CodecWindow(rng.integers(0, MIMI_CODES, size=(9, CODEBOOKS)), 10, 18, 19),
        CodecWindow(rng.integers(0, MIMI_CODES, size=(9, CODEBOOKS)), 0, 0, 9),
        CodecWindow(rng.integers(0, MIMI_CODES, size=(3, CODEBOOKS)), 0, 0, 3),  # its own call
        CodecWindow(np.empty((0, CODEBOOKS), dtype=np.int64), 4, 4, 4),  # nothing to sound
    ]
    batched = codec.decode(windows)
    assert [a.shape[0] for a in batched] == [SPF, 9 * SPF, 3 * SPF, 0]
    # A batch of 2 runs the convolutions' and the transformer's float32 reductions in another order
    # than a batch of 1: errors of ~1e-6 of the signal's scale (samples up to ~10 with random
    # weights), on small samples too, so the bound is 1e-5 of the window's peak.
    for a, w in zip(batched, windows, strict=True):
        alone = codec.decode([w])[0]
        np.testing.assert_allclose(a, alone, atol=1e-5 * max(1.0, float(np.abs(alone).max(initial=0))))


def test_encode_is_mimis_own_encoder(mimi_dir: Path, codec: MimiCodec) -> None:
    pcm = np.random.default_rng(5).uniform(-0.5, 0.5, 6 * SPF).astype(np.float32)
    codes = codec.encode(pcm, CODEBOOKS)
    model = transformers.MimiModel.from_pretrained(str(mimi_dir)).eval()
    with torch.no_grad():
        ref = model.encode(torch.from_numpy(pcm)[None, None]).audio_codes[0].T.numpy()
    assert codes.shape == (6, CODEBOOKS) and len(np.unique(codes)) > 5
    np.testing.assert_array_equal(codes, ref)


def test_csm_rows_frame_only_their_audio() -> None:
    lay = layout("csm")
    rows = np.array([[5, 6, 7, ABSENT], [ABSENT, ABSENT, ABSENT, 42], [0, 0, 9, ABSENT], [0, 0, 0, ABSENT]])
    assert lay.frame_width(4) == 3
    np.testing.assert_array_equal(lay.codes(rows, 0), [5, 6, 7])  # a text row and the end frame are not audio


def test_bad_windows_are_refused(codec: MimiCodec) -> None:
    with pytest.raises(ValueError, match="Mimi frames have"):
        codec.decode([CodecWindow(np.zeros((2, CODEBOOKS + 1), dtype=np.int64), 0, 0, 2)])
    with pytest.raises(ValueError, match="must lie in"):
        codec.decode([CodecWindow(np.full((2, CODEBOOKS), MIMI_CODES), 0, 0, 2)])


def test_settings_choose_mimi_and_its_rate_floor(mimi_dir: Path) -> None:
    settings = parse_settings({"codec.kind": "mimi", "codec.path": str(mimi_dir)})
    spec = codec_spec(settings)
    assert (spec.layout, spec.lookback, spec.lookahead) == ("csm", 8, 0)
    assert (spec.sample_rate, spec.samples_per_frame, spec.rows_per_second) == (24000, SPF, 12.5)
    assert settings.batch.rate_floor_tok_s == 25.0  # 12.5 frames (rows) a second, twice real time
    assert isinstance(build_codec(settings, torch.device("cpu")), MimiCodec)


def test_a_directory_that_is_not_mimi_is_refused(tmp_path: Path, mimi_dir: Path) -> None:
    (tmp_path / "config.json").write_text((mimi_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no model\.safetensors"):
        parse_settings({"codec.kind": "mimi", "codec.path": str(tmp_path)})
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text('{"model_type": "encodec"}')
    with pytest.raises(ValueError, match="model_type"):
        parse_settings({"codec.kind": "mimi", "codec.path": str(tmp_path)})
