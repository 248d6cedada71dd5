"""CSM's audio rows: which generated rows are Mimi frames, and how a row carries one.

A CSM stream's rows are N + 1 ids (backend/model/csm.py, `CsmRows`): Mimi's N codes of one frame,
then the text column (ABSENT, -1, in generated rows). Each generated row is one frame, so a frame is
one LM step (rows_per_frame 1: the backbone's step and its depth steps make the row). The end frame
(codebooks 0..N-2 all CSM's codebook eos id, 0 in CSM-1B) ends the stream and is not audio, as
Sesame's generator drops it; a row with an ABSENT code (a text row) is not audio either.

Pure numpy, vectorised: D calls it on its engine thread for every chunk.
"""

from __future__ import annotations

import numpy as np

CODEBOOK_EOS = 0  # CSM-1B's codebook_eos_token_id


class CsmLayout:
    """`AudioLayout` (backend/codec/base.py) for CSM over Mimi: rows of N + 1 ids -> frames of N."""

    name = "csm"
    rows_per_frame = 1

    def __init__(self, codebook_eos: int = CODEBOOK_EOS) -> None:
        self.codebook_eos = codebook_eos

    def frame_width(self, row_width: int) -> int:
        """Codes per frame: the row without its text column."""
        if row_width < 3:
            raise ValueError(f"CSM rows carry N >= 2 codes and a text column, not {row_width} ids")
        return row_width - 1

    def codes(self, rows: np.ndarray, audio_index: int) -> np.ndarray:
        """Flat int64 codes of the audio frames among `rows` [R, N + 1] (read only), in order."""
        r = np.asarray(rows, dtype=np.int64)
        frames = r[:, :-1]
        audio = (frames >= 0).all(axis=1) & ~(frames[:, :-1] == self.codebook_eos).all(axis=1)
        return frames[audio].reshape(-1)

    def codec_order(self, frames: np.ndarray) -> np.ndarray:
        """Frames [F, N]: codebook k is Mimi's quantizer k already (a new array)."""
        return np.ascontiguousarray(frames)
