"""Orpheus' token ids, the one copy: its turn markers and the layout of its audio ids.

Orpheus (canopyai/Orpheus-TTS) is a Llama with the Llama-3 text vocabulary (`<|eot_id|>` 128009) and
`<custom_token_N>` at id 128256 + N. A prompt is `[START_OF_HUMAN] + text + [END_OF_TEXT,
END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]`; the model answers with audio ids and ends with
END_OF_SPEECH (then END_OF_AI). The i-th audio id of a stream is

    AUDIO_BASE + (i mod SLOTS) * CODES_PER_SLOT + code          code in [0, CODES_PER_SLOT)

Read by the grammar (`grammar.py`: which ids a step may sample), the codec's layout
(`backend/codec/orpheus.py`: ids -> SNAC frames), the text front end and the cloning prefix
(`backend/text/frontend.py`, `cloning.py`: the prompt's markers) and the family check
(`backend/text/families.py`). It lives here, the lowest of those rooms, so that each imports it.
"""

from __future__ import annotations

END_OF_TEXT = 128009  # <|eot_id|> (Llama 3)
CUSTOM_TOKEN_BASE = 128256  # <custom_token_0>: <custom_token_N> is CUSTOM_TOKEN_BASE + N
START_OF_SPEECH = CUSTOM_TOKEN_BASE + 1
END_OF_SPEECH = CUSTOM_TOKEN_BASE + 2
START_OF_HUMAN = CUSTOM_TOKEN_BASE + 3
END_OF_HUMAN = CUSTOM_TOKEN_BASE + 4
START_OF_AI = CUSTOM_TOKEN_BASE + 5
END_OF_AI = CUSTOM_TOKEN_BASE + 6

AUDIO_BASE = CUSTOM_TOKEN_BASE + 10  # <custom_token_10>: code 0 of slot 0
SLOTS = 7  # audio ids per SNAC frame: [L0, L1a, L2a, L2b, L1b, L2c, L2d]
CODES_PER_SLOT = 4096  # one SNAC codebook
AUDIO_END = AUDIO_BASE + SLOTS * CODES_PER_SLOT  # one past the last audio id: the least vocabulary
VOCAB_SIZE = 156940  # the released checkpoints' vocabulary (two ids past AUDIO_END)
