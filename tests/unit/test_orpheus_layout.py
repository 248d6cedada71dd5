"""Orpheus' audio-token layout: ids <-> SNAC codes, frame order, and what is not audio.

The convention checked here is canopyai/Orpheus-TTS `orpheus_tts/decoder.py`: `<custom_token_N>` is id
128256 + N, the i-th audio token's code is N - 10 - (i mod 7) * 4096, and frame j is
[L0, L1a, L2a, L2b, L1b, L2c, L2d] = tokens 7j .. 7j+6 with L1 = (7j+1, 7j+4), L2 = (7j+2, 7j+3, 7j+5, 7j+6).
"""

from __future__ import annotations

import numpy as np

from tandem.backend.codec.orpheus import OrpheusLayout
from tandem.backend.generation.orpheus_ids import AUDIO_BASE, END_OF_SPEECH
from tandem.backend.generation.orpheus_ids import CODES_PER_SLOT as CODEBOOK

LAYOUT = OrpheusLayout()


def _upstream_codes(custom_numbers: list[int]) -> list[int]:
    """The reference's arithmetic, from custom-token numbers (audio tokens only)."""
    return [n - 10 - (i % 7) * 4096 for i, n in enumerate(custom_numbers)]


def test_ids_match_the_upstream_custom_token_arithmetic() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, CODEBOOK, size=21)
    ids = np.array([AUDIO_BASE + (i % 7) * CODEBOOK + c for i, c in enumerate(codes)])
    assert AUDIO_BASE == 128256 + 10
    assert _upstream_codes([int(i) - 128256 for i in ids]) == codes.tolist()
    assert LAYOUT.codes(ids.reshape(-1, 1), 0).tolist() == codes.tolist()


def test_frame_order_is_L0_L1a_L2a_L2b_L1b_L2c_L2d() -> None:
    orpheus = np.arange(14).reshape(2, 7)  # two frames as the model emits them
    snac = LAYOUT.codec_order(orpheus)
    # canonical: [L0, L1a, L1b, L2a, L2b, L2c, L2d]
    assert snac.tolist() == [[0, 1, 4, 2, 3, 5, 6], [7, 8, 11, 9, 10, 12, 13]]
    assert LAYOUT.tokens(snac).reshape(-1).tolist() == [
        AUDIO_BASE + (i % 7) * CODEBOOK + c for i, c in enumerate(orpheus.reshape(-1))
    ]


def test_tokens_round_trip_through_codes() -> None:
    frames = np.random.default_rng(1).integers(0, CODEBOOK, size=(5, 7))
    ids = LAYOUT.tokens(frames)
    assert ids.shape == (35, 1)
    flat = LAYOUT.codes(ids, 0)
    assert np.array_equal(LAYOUT.codec_order(flat.reshape(-1, 7)), frames)


def test_non_audio_tokens_are_skipped_and_do_not_advance_the_index() -> None:
    frames = np.random.default_rng(2).integers(0, CODEBOOK, size=(2, 7))
    ids = LAYOUT.tokens(frames).reshape(-1)
    noisy = np.concatenate([[128257, 42], ids[:3], [128000, 128265], ids[3:], [END_OF_SPEECH, 156939]])
    whole = LAYOUT.codes(ids.reshape(-1, 1), 0)
    assert np.array_equal(LAYOUT.codes(noisy.reshape(-1, 1), 0), whole)
    # split anywhere, with the running audio index, the codes are the same
    a, b = noisy[:6], noisy[6:]
    first = LAYOUT.codes(a.reshape(-1, 1), 0)
    assert np.array_equal(np.concatenate([first, LAYOUT.codes(b.reshape(-1, 1), first.shape[0])]), whole)


def test_a_misplaced_token_counts_with_its_offset_in_its_own_block() -> None:
    # slot 3's range at audio index 0: still audio index 0, code = offset inside slot 3's block
    ids = np.array([[AUDIO_BASE + 3 * CODEBOOK + 17], [AUDIO_BASE + 1 * CODEBOOK + 5]])
    assert LAYOUT.codes(ids, 0).tolist() == [17, 5]
    assert LAYOUT.codes(np.empty((0, 1), dtype=np.int64), 4).shape == (0,)
