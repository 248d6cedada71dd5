"""Sesame CSM's prompt: the context utterances (text, then the reference's Mimi frames) and the text
to speak, as backbone rows of N + 1 ids (backend/model/csm.py, `CsmRows`).

Sesame's layout (its `generator.py`, which transformers' `CsmProcessor` chat template reproduces):
each utterance is its text segment, the tokens of ``f"[{speaker}]{text}"`` with the tokenizer's
begin/end-of-text around them, one text row each (the codebook columns ABSENT); a context utterance
then has its audio, one row per Mimi frame (the text column ABSENT), closed by one end frame whose
codebooks all hold CSM's codebook eos id (transformers' `<|audio_eos|>` position). The utterance to
speak is its text segment only; generation continues with frames.

Packing is one allocation and one slice assignment per utterance part (no per-row loop): a voice's
prefix is a few hundred frames, a request's text a few dozen tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tandem.backend.model.csm import ABSENT, CsmRows


@dataclass(frozen=True)
class Utterance:
    """One turn of a CSM prompt: `text_ids` (int64 [L], the tokenizer's ids of ``[speaker]text``,
    begin/end-of-text included) and `frames` (int64 [F, N] Mimi codes of its audio; None for the
    turn to speak)."""

    text_ids: np.ndarray
    frames: np.ndarray | None = None


def speaker_text(speaker: int, text: str) -> str:
    """The text a CSM utterance's segment encodes: ``[speaker]text``."""
    return f"[{speaker}]{text}"


def prompt_rows(utterances: Sequence[Utterance], rows: CsmRows, codebook_eos: int) -> np.ndarray:
    """int64 [T, N + 1] backbone rows of `utterances` in order (module docstring); the caller owns
    them. Raises ValueError for frames of the wrong width, codes or text ids out of range, or an
    utterance with no text."""
    n = rows.codebooks
    total = 0
    for i, u in enumerate(utterances):
        ids = np.asarray(u.text_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"utterance {i}: text_ids must be a non-empty 1-D array")
        if ids.min() < 0 or ids.max() >= rows.text_vocab:
            raise ValueError(f"utterance {i}: text ids must lie in [0, {rows.text_vocab})")
        total += ids.size
        if u.frames is not None:
            f = np.asarray(u.frames)
            if f.ndim != 2 or f.shape[1] != n:
                raise ValueError(f"utterance {i}: frames must be [F, {n}], got {list(f.shape)}")
            if f.size and (f.min() < 0 or f.max() >= rows.codebook_vocab):
                raise ValueError(f"utterance {i}: codes must lie in [0, {rows.codebook_vocab})")
            total += f.shape[0] + 1
    out = np.full((total, rows.width), ABSENT, dtype=np.int64)
    at = 0
    for u in utterances:
        ids = np.asarray(u.text_ids, dtype=np.int64)
        out[at : at + ids.size, rows.text_column] = ids
        at += ids.size
        if u.frames is not None:
            f = np.asarray(u.frames, dtype=np.int64)
            out[at : at + f.shape[0], :n] = f
            out[at + f.shape[0], :n] = codebook_eos
            at += f.shape[0] + 1
    return out
