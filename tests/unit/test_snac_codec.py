"""SNAC behind the codec seam (real `snac` package, real 24 kHz config, random weights).

Streamed audio — D's windows with lookback/lookahead, decoded one chunk at a time — must equal SNAC's
offline decode of the whole code sequence to >= 40 dB SNR (noise off). Kept to a few frames: SNAC on
a 2-core CPU is slower than real time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.backend.codec.base import CodecWindow, Framing
from tandem.backend.codec.builder import build_codec, codec_spec
from tandem.backend.codec.orpheus import OrpheusLayout
from tandem.backend.codec.snac import SnacCodec, snac_spec
from tandem.backend.settings import parse_settings
from tests.support.snac_dir import write_snac_dir

FRAMES = 12


@pytest.fixture(scope="module")
def snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_snac_dir(tmp_path_factory.mktemp("snac"), noise=False)


@pytest.fixture(scope="module")
def codec(snac_dir: Path) -> SnacCodec:
    return SnacCodec(snac_dir, snac_spec(snac_dir, "orpheus", 2, 1, 7), torch.device("cpu"))


@pytest.fixture(scope="module")
def frames() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 4096, size=(FRAMES, 7))  # canonical order


def _offline(codec: SnacCodec, frames: np.ndarray) -> np.ndarray:
    return codec.decode([CodecWindow(frames, 0, 0, frames.shape[0])])[0]


def _streamed(
    codec: SnacCodec, frames: np.ndarray, lookback: int, lookahead: int, sizes: list[int]
) -> np.ndarray:
    layout = OrpheusLayout()
    rows = np.concatenate([layout.tokens(frames), [[128258]]])
    assert sum(sizes) == rows.shape[0]
    track = Framing(layout, lookback, lookahead).track(1)
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


def test_spec_is_read_from_the_config(snac_dir: Path) -> None:
    spec = snac_spec(snac_dir, "orpheus", 2, 1, 7)
    assert (spec.sample_rate, spec.samples_per_frame, spec.rows_per_second) == (24000, 2048, 82.03125)


def test_offline_decode_is_2048_samples_per_frame(codec: SnacCodec, frames: np.ndarray) -> None:
    audio = _offline(codec, frames)
    assert audio.dtype == np.float32 and audio.shape == (FRAMES * 2048,)
    assert np.all(np.abs(audio) <= 1.0) and np.std(audio) > 0


@pytest.mark.parametrize("lookahead,min_db", [(1, 40.0), (2, 80.0)])
def test_streamed_audio_equals_the_offline_decode(
    codec: SnacCodec, frames: np.ndarray, lookahead: int, min_db: float
) -> None:
    # chunks as D cuts them for Orpheus: 14 rows first, then 28, then the rest (the EOS row last)
    sizes = [14, 28, 28, 15]
    streamed = _streamed(codec, frames, 2, lookahead, sizes)
    assert _snr_db(_offline(codec, frames), streamed) >= min_db


def test_without_lookahead_the_stream_is_audibly_off(codec: SnacCodec, frames: np.ndarray) -> None:
    """Why the context exists: per-frame chunks with no context fall far below 40 dB."""
    few = frames[:6]
    streamed = _streamed(codec, few, 0, 0, [7] * 6 + [1])
    assert _snr_db(_offline(codec, few), streamed) < 40.0


def test_one_batched_call_equals_one_call_per_stream(codec: SnacCodec) -> None:
    rng = np.random.default_rng(3)
    windows = [
        CodecWindow(rng.integers(0, 4096, size=(5, 7)), 10, 12, 14),
        CodecWindow(rng.integers(0, 4096, size=(5, 7)), 0, 0, 4),
        CodecWindow(rng.integers(0, 4096, size=(3, 7)), 0, 0, 3),  # another length: its own call
        CodecWindow(np.empty((0, 7), dtype=np.int64), 4, 4, 4),  # nothing to sound
    ]
    batched = codec.decode(windows)
    single = [codec.decode([w])[0] for w in windows]
    assert [a.shape[0] for a in batched] == [2 * 2048, 4 * 2048, 3 * 2048, 0]
    for a, b in zip(batched, single, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_bad_windows_are_refused(codec: SnacCodec) -> None:
    with pytest.raises(ValueError, match="SNAC frames have 7 codes"):
        codec.decode([CodecWindow(np.zeros((2, 4), dtype=np.int64), 0, 0, 2)])
    with pytest.raises(ValueError, match="must lie in"):
        codec.decode([CodecWindow(np.full((2, 7), 4096), 0, 0, 2)])


def test_the_noise_flag_is_honoured(tmp_path: Path) -> None:
    noisy_dir = write_snac_dir(tmp_path / "noisy", noise=True)
    noisy = SnacCodec(noisy_dir, snac_spec(noisy_dir, "orpheus", 2, 1, 7), torch.device("cpu"))
    w = CodecWindow(np.random.default_rng(4).integers(0, 4096, size=(2, 7)), 0, 0, 2)
    a, b = noisy.decode([w])[0], noisy.decode([w])[0]
    assert not np.array_equal(a, b)  # fresh decoder noise in every call, as the config asks


def test_settings_choose_the_codec_and_the_rate_floor(snac_dir: Path) -> None:
    default = parse_settings({})
    assert codec_spec(default).rows_per_second == 21 and default.batch.rate_floor_tok_s == 42.0
    snac = parse_settings({"codec.kind": "snac", "codec.path": str(snac_dir)})
    spec = codec_spec(snac)
    assert (spec.layout, spec.lookback, spec.lookahead) == ("orpheus", 2, 1)
    assert snac.batch.rate_floor_tok_s == pytest.approx(164.0625)
    tighter = parse_settings({"codec.kind": "snac", "codec.path": str(snac_dir), "rate.rtf": "0.25"})
    assert tighter.batch.rate_floor_tok_s == pytest.approx(328.125)
    fixed = parse_settings(
        {"codec.kind": "snac", "codec.path": str(snac_dir), "batch.rate_floor_tok_s": "100"}
    )
    assert fixed.batch.rate_floor_tok_s == 100.0
    assert isinstance(build_codec(snac, torch.device("cpu")), SnacCodec)


@pytest.mark.parametrize(
    "params,match",
    [
        ({"codec.kind": "encodec"}, "codec.kind"),
        ({"codec.kind": "snac"}, "codec.path"),
        ({"codec.kind": "snac", "codec.path": "/nonexistent"}, "codec.path"),
        ({"codec.layout": "llasa"}, "codec.layout"),
        ({"rate.rtf": "0"}, "rate.rtf"),
        ({"batch.rate_floor_tok_s": "-1"}, "rate_floor_tok_s"),
        ({"rate.speed": "2"}, "unknown parameter"),
    ],
)
def test_bad_codec_settings_name_the_parameter(params: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_settings(params)


def test_a_directory_without_weights_is_refused(tmp_path: Path, snac_dir: Path) -> None:
    (tmp_path / "config.json").write_text((snac_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no pytorch_model\.bin"):
        parse_settings({"codec.kind": "snac", "codec.path": str(tmp_path)})


def test_encode_regroups_snacs_levels_into_canonical_frames(codec: SnacCodec) -> None:
    """`encode` (registered voices): SNAC's own `encode` of 24 kHz audio, its three levels (12, 24, 48
    codes a second) regrouped per frame as [c0[i], c1[2i], c1[2i+1], c2[4i..4i+3]], written out here;
    SNAC pads the audio to whole 2,048-sample frames."""
    pcm = (0.3 * np.sin(2 * np.pi * 220 * np.arange(30000) / 24000)).astype(np.float32)
    frames = codec.encode(pcm, 7)
    with torch.inference_mode():
        c0, c1, c2 = (c[0].numpy() for c in codec._model.encode(torch.from_numpy(pcm).reshape(1, 1, -1)))
    assert frames.dtype == np.int64 and frames.shape == (15, 7)  # 30,000 samples -> 15 frames
    for i in range(15):
        assert frames[i].tolist() == [c0[i], c1[2 * i], c1[2 * i + 1], *c2[4 * i : 4 * i + 4]]
    with pytest.raises(ValueError, match="SNAC frames have 7 codes, asked for 4"):
        codec.encode(pcm, 4)


def test_folded_weight_norm_decodes_as_snac_itself(snac_dir: Path, codec: SnacCodec) -> None:
    """The codec folds SNAC's weight-norm parametrisations at load: none is left, and the audio is
    the unfolded package model's to float rounding."""
    from snac import SNAC
    from torch.nn.utils import parametrize

    assert not any(parametrize.is_parametrized(m) for m in codec._model.modules())
    upstream = SNAC.from_pretrained(str(snac_dir)).eval()
    assert any(parametrize.is_parametrized(m) for m in upstream.modules())
    frames = np.random.default_rng(5).integers(0, 4096, size=(4, 7))
    with torch.inference_mode():
        ref = upstream.decode(codec.levels(torch.from_numpy(frames[None])))[0, 0].numpy()
    assert _snr_db(ref, _offline(codec, frames)) >= 80.0


def test_warmed_lengths_are_the_windows_a_stream_sends(codec: SnacCodec) -> None:
    """`ChunkPolicy.window_frames` names the window lengths a stream's chunks really carry (cut by
    `FrameTrack`), so warming them covers every non-final chunk; `warm` decodes each once."""
    from tandem.backend.codec.reference import ChunkPolicy

    layout = OrpheusLayout()
    framing = Framing(layout, 2, 1)
    policy = ChunkPolicy(14, 2.0, 112, framing)
    rows = layout.tokens(np.random.default_rng(2).integers(0, 4096, size=(60, 7)))
    track, seen, at = framing.track(1), [], 0
    for size in policy.chunk_sizes(rows.shape[0])[:-1]:
        track.push(rows[at : at + size])
        at += size
        n = track.window(final=False).frames.shape[0]
        if n and n not in seen:
            seen.append(n)
    assert policy.window_frames(7) == seen == [2, 6, 11, 19]
    codec.warm(seen)
