"""Orpheus' audio tokens: which generated ids are SNAC codes, and how seven of them make a frame.

Orpheus (canopyai/Orpheus-TTS) is a Llama LM whose vocabulary ends in 7 x 4096 audio tokens. The
i-th audio token of a stream (i counts audio tokens only, from 0) is

    AUDIO_BASE + (i mod 7) * 4096 + code          code in [0, 4096)

and every seven audio tokens are one SNAC 24 kHz frame (2,048 samples), in the order
`[L0, L1a, L2a, L2b, L1b, L2c, L2d]`: one code of SNAC's coarsest level, two of the middle one, four of
the finest, interleaved as the model was trained to emit them (the ids:
`backend/generation/orpheus_ids.py`). Every other id (end of speech, text, the other special tokens)
is not audio and is skipped: it neither makes sound nor moves i.

A token whose id lies in another slot's range than `i mod 7` (possible only without the audio-token
grammar, which Orpheus serving turns on) still counts as the i-th audio token; its code is its offset
inside its own 4096-block, so every id decodes to a valid code and the stream keeps its frame
alignment. The upstream reference instead drops the whole window of such a frame.

Pure numpy; D calls it on its engine thread for every chunk, so it is vectorised and never loops per
token.
"""

from __future__ import annotations

import numpy as np

from tandem.backend.generation.orpheus_ids import AUDIO_BASE, AUDIO_END, SLOTS
from tandem.backend.generation.orpheus_ids import CODES_PER_SLOT as CODEBOOK

# Position of SNAC's canonical frame order [L0, L1a, L1b, L2a, L2b, L2c, L2d] in Orpheus' order.
_TO_SNAC = np.array([0, 1, 4, 2, 3, 5, 6])
_TO_ORPHEUS = np.argsort(_TO_SNAC)


class OrpheusLayout:
    """`AudioLayout` (backend/codec/base.py) for Orpheus over SNAC 24 kHz: rows of width 1 -> frames of 7."""

    name = "orpheus"
    rows_per_frame = SLOTS  # with row width 1: seven LM steps per frame

    def frame_width(self, row_width: int) -> int:
        """Codes per frame (7). Orpheus emits one id per row; a wider row is read row-major."""
        return SLOTS

    def codes(self, rows: np.ndarray, audio_index: int) -> np.ndarray:
        """SNAC codes of the audio tokens among `rows` (int [N, W], read only), in stream order.

        `audio_index` is how many audio tokens the stream had before these rows. Returns a new int64
        array [n] with 0 <= code < 4096, n = the number of audio tokens in `rows`.
        """
        ids = np.asarray(rows, dtype=np.int64).reshape(-1)
        audio = ids[(ids >= AUDIO_BASE) & (ids < AUDIO_END)] - AUDIO_BASE
        slot = (audio_index + np.arange(audio.shape[0], dtype=np.int64)) % SLOTS
        code = audio - slot * CODEBOOK
        misplaced = (code < 0) | (code >= CODEBOOK)
        return np.where(misplaced, audio % CODEBOOK, code)

    def codec_order(self, frames: np.ndarray) -> np.ndarray:
        """Frames [F, 7] in Orpheus' order -> SNAC's canonical order [L0, L1a, L1b, L2a..L2d] (new array)."""
        return np.ascontiguousarray(frames[:, _TO_SNAC])

    def tokens(self, frames: np.ndarray) -> np.ndarray:
        """The inverse: frames [F, 7] in SNAC's canonical order -> the 7F token ids Orpheus emits for
        them (int64 [7F, 1] rows). For tests and benchmarks that need a stream of given codes."""
        f = np.asarray(frames, dtype=np.int64)[:, _TO_ORPHEUS]
        return (AUDIO_BASE + np.arange(SLOTS, dtype=np.int64) * CODEBOOK + f).reshape(-1, 1)
