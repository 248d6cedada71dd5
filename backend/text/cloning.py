"""The family's cloning template: a registered voice's prompt prefix, from its transcript and codes.

The prompt first shows a turn of text with the speech that says it, then the new text; the prefix
comes first and is the same for every request with the voice, so P's prefix cache keeps its KV
(docs/codecs.md, "Registered voices").

- `orpheus` (Orpheus-TTS's pretrained zero-shot layout): ``[START_OF_HUMAN] + encode(transcript) +
  [END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH] + <reference audio tokens> + [END_OF_SPEECH,
  END_OF_AI]`` (`backend/generation/orpheus_ids.py`), then the request's turn
  without a voice name; audio tokens in Orpheus' 7-token interleave (`OrpheusLayout.tokens`).
- `plain`: the transcript's rows (column 0), the reference's frames as rows, then the text's rows.

A voice whose codes this model cannot read is `InvalidInput` naming VOICE.
"""

from __future__ import annotations

import numpy as np

from tandem.backend.codec.orpheus import OrpheusLayout
from tandem.backend.errors import InvalidInput
from tandem.backend.generation import orpheus_ids as orpheus
from tandem.backend.model.config import ModelConfig
from tandem.backend.text.tokenizer import TextTokenizer
from tandem.backend.voices.store import VoiceRecord

# Orpheus' ids around the reference's transcript and speech (the notebook's end_of_speech, end_of_ai).
_ORPHEUS_TURN = (orpheus.END_OF_TEXT, orpheus.END_OF_HUMAN, orpheus.START_OF_AI, orpheus.START_OF_SPEECH)


def _frames(record: VoiceRecord, width: int, codebook: int, what: str) -> np.ndarray:
    frames = np.asarray(record.frames, dtype=np.int64)
    if frames.ndim != 2 or frames.shape[0] == 0 or frames.shape[1] != width:
        raise InvalidInput(
            f"VOICE {record.name!r} was registered with {record.codec} frames of {record.frame_width} codes; "
            f"this model's {what} takes frames of {width}"
        )
    if frames.min() < 0 or frames.max() >= codebook:
        raise InvalidInput(f"VOICE {record.name!r} holds codes outside [0, {codebook}) for this model")
    return frames


def orpheus_prefix(tokenizer: TextTokenizer, record: VoiceRecord) -> np.ndarray:
    """Orpheus' zero-shot prefix ids (int64 [P]) for `record`."""
    frames = _frames(record, orpheus.SLOTS, orpheus.CODES_PER_SLOT, "Orpheus layout (SNAC 24 kHz)")
    audio = OrpheusLayout().tokens(frames).reshape(-1)
    text = tokenizer.encode(record.transcript)
    head = np.array([orpheus.START_OF_HUMAN, *text, *_ORPHEUS_TURN], dtype=np.int64)
    tail = np.array([orpheus.END_OF_SPEECH, orpheus.END_OF_AI], dtype=np.int64)
    return np.concatenate([head, audio, tail])


def plain_prefix(tokenizer: TextTokenizer, record: VoiceRecord, cfg: ModelConfig) -> np.ndarray:
    """The plain family's prefix rows (int64 [P, W]): transcript rows, then the reference's frames."""
    frames = _frames(record, cfg.row_width, cfg.vocab_size, f"rows ({cfg.row_width} ids)")
    text = tokenizer.encode(record.transcript)
    rows = np.zeros((len(text), cfg.row_width), dtype=np.int64)
    rows[:, 0] = text
    return np.concatenate([rows, frames])
