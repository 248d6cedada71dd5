"""The family's cloning template: a registered voice's prompt prefix, from its transcript and codes.

Zero-shot cloning on an audio-token LM is in-context: the prompt first shows the model a turn of
text with the speech that says it, then asks for the new text; the model continues in that voice.
The prefix is the same for every request with the voice and comes first, so P's prefix cache keeps
its KV and a second request prefills only the new text (docs/codecs.md, "Registered voices").

- `orpheus` (canopyai/Orpheus-TTS, the pretrained model's zero-shot layout, PR #170's
  `Orpheus_0_1_Pretrain_Inference.ipynb`):
  ``[128259] + encode(transcript) + [128009, 128260, 128261, 128257] + <reference audio tokens>
  + [128258, 128262]``, then the request's own turn ``[128259] + encode(text) + [128009, 128260,
  128261, 128257]`` (the template without a voice name); `encode` adds BOS 128000. Audio tokens are
  the reference's SNAC frames in Orpheus' 7-token interleave (`OrpheusLayout.tokens`).
- `plain`: the transcript's rows (one token per row, column 0), then the reference's frames as rows
  (a frame is a row of W ids, the reference codec's `rows` layout), then the text's rows.

Pure and cheap after the first call per voice (the reader caches the prefix, `frontend.py`).
A voice whose codes this model cannot read (another codec's frames) is `InvalidInput` naming VOICE.
"""

from __future__ import annotations

import numpy as np

from tandem.backend.codec.orpheus import CODEBOOK, SLOTS, OrpheusLayout
from tandem.backend.errors import InvalidInput
from tandem.backend.model.config import ModelConfig
from tandem.backend.text.tokenizer import TextTokenizer
from tandem.backend.voices.store import VoiceRecord

# Orpheus' ids around the reference's speech (the notebook's end_of_speech, end_of_ai).
ORPHEUS_END_OF_SPEECH = 128258
ORPHEUS_END_OF_AI = 128262
_ORPHEUS_TURN = (128009, 128260, 128261, 128257)  # end of text, end of human, start of AI, start of speech
_ORPHEUS_START = 128259  # start of human


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
    frames = _frames(record, SLOTS, CODEBOOK, "Orpheus layout (SNAC 24 kHz)")
    audio = OrpheusLayout().tokens(frames).reshape(-1)
    text = tokenizer.encode(record.transcript)
    head = np.array([_ORPHEUS_START, *text, *_ORPHEUS_TURN], dtype=np.int64)
    tail = np.array([ORPHEUS_END_OF_SPEECH, ORPHEUS_END_OF_AI], dtype=np.int64)
    return np.concatenate([head, audio, tail])


def plain_prefix(tokenizer: TextTokenizer, record: VoiceRecord, cfg: ModelConfig) -> np.ndarray:
    """The plain family's prefix rows (int64 [P, W]): transcript rows, then the reference's frames."""
    frames = _frames(record, cfg.row_width, cfg.vocab_size, f"rows ({cfg.row_width} ids)")
    text = tokenizer.encode(record.transcript)
    rows = np.zeros((len(text), cfg.row_width), dtype=np.int64)
    rows[:, 0] = text
    return np.concatenate([rows, frames])
