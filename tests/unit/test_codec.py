"""The codec seam: D's FrameTrack cuts windows that emit every frame once, in order, with context;
the reference codec through windows is exactly the row-by-row synthesis."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tandem.backend.codec.base import CodecSpec, CodecWindow, Framing, RowLayout, format_rate
from tandem.backend.codec.config import VocoderConfig
from tandem.backend.codec.orpheus import OrpheusLayout
from tandem.backend.codec.reference import ReferenceVocoder


def _windows(framing: Framing, rows: np.ndarray, sizes: list[int]) -> list[CodecWindow]:
    track = framing.track(rows.shape[1])
    out, at = [], 0
    for i, n in enumerate(sizes):
        track.push(rows[at : at + n])
        at += n
        out.append(track.window(final=i == len(sizes) - 1))
    return out


@pytest.mark.parametrize("lookback,lookahead", [(0, 0), (2, 1), (3, 2)])
def test_windows_emit_every_frame_once_from_frame_0(lookback: int, lookahead: int) -> None:
    frames = np.random.default_rng(0).integers(0, 4096, size=(9, 7))
    layout = OrpheusLayout()
    rows = np.concatenate([layout.tokens(frames), [[128258]]])  # end of speech ends it
    ws = _windows(Framing(layout, lookback, lookahead), rows, [4, 10, 14, 21, 15])
    emitted = [(w.emit_from, w.emit_to) for w in ws if w.emitted]
    assert emitted[0][0] == 0 and emitted[-1][1] == 9  # the first frame is not dropped
    assert all(a[1] == b[0] for a, b in itertools.pairwise(emitted))
    for w in ws:
        if not w.emitted:
            assert w.frames.shape == (0, 7)
            continue
        assert w.first_frame == max(0, w.emit_from - lookback)
        end = w.first_frame + w.frames.shape[0]
        assert end == (w.emit_to + lookahead if w is not ws[-1] else 9)
        assert np.array_equal(w.frames, frames[w.first_frame : end])  # canonical order


def test_a_non_final_chunk_holds_back_the_lookahead_and_a_partial_frame_is_silent() -> None:
    frames = np.random.default_rng(1).integers(0, 4096, size=(3, 7))
    rows = OrpheusLayout().tokens(frames)[:-3]  # two frames and four codes of a third
    track = Framing(OrpheusLayout(), 2, 1).track(1)
    track.push(rows[:7])
    assert track.window(final=False).emitted == 0  # frame 0 waits for frame 1
    track.push(rows[7:])
    w = track.window(final=False)
    assert (w.emit_from, w.emit_to) == (0, 1)
    last = track.window(final=True)
    assert (last.emit_from, last.emit_to, track.frames) == (1, 2, 2)


def test_reference_codec_through_windows_is_the_row_synthesis() -> None:
    voc = ReferenceVocoder(VocoderConfig())
    rows = np.random.default_rng(2).integers(0, 1024, size=(37, 4))
    ws = _windows(Framing(RowLayout()), rows, [4, 8, 16, 9])
    spans = [(w.first_frame, w.emit_from, w.emit_to) for w in ws]
    assert spans == [(0, 0, 4), (4, 4, 12), (12, 12, 28), (28, 28, 37)]
    audio = np.concatenate(voc.decode(ws))
    assert np.array_equal(audio, voc.synthesize(rows, 0))
    assert voc.spec.rows_per_second == 21 and voc.spec.lookahead == 0


def test_window_arrays_round_trip_and_bad_ones_are_refused() -> None:
    w = CodecWindow(np.zeros((5, 7), dtype=np.int64), 3, 4, 6)
    back = CodecWindow.from_arrays(w.frames, w.as_array())
    assert (back.first_frame, back.emit_from, back.emit_to) == (3, 4, 6)
    with pytest.raises(ValueError, match="outside its frames"):
        CodecWindow(np.zeros((2, 7), dtype=np.int64), 3, 4, 6)
    with pytest.raises(ValueError, match="WINDOW must be 3 integers"):
        CodecWindow.from_arrays(w.frames, np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="CODES must be integers"):
        CodecWindow.from_arrays(w.frames.astype(np.float32), w.as_array())


def test_spec_rates() -> None:
    orpheus = CodecSpec("snac", "orpheus", 24000, 2048, 7, 2, 1)
    assert orpheus.rows_per_second == 82.03125
    assert format_rate(orpheus.rows_per_second) == "82.03125" and format_rate(21.0) == "21"
    with pytest.raises(ValueError, match="lookahead"):
        CodecSpec("snac", "orpheus", 24000, 2048, 7, 2, -1)
