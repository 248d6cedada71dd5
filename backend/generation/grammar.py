"""Audio-token grammars: which ids a stream may sample at each of its generated positions.

A grammar masks every id the codec could not decode (a text token, an audio id of the wrong slot).
It is a pure function of (grammar, audio position), so P, D and the monolithic engine sample the same.

Orpheus (SNAC 24 kHz, seven ids per frame): the i-th audio token (i = 0 first generated) is
`AUDIO_BASE + (i mod 7) * 4096 + code`, code in [0, 4096) (`orpheus_ids.py`). At position i only
slot `i mod 7`'s 4,096 ids and end-of-speech may be sampled.

Two views of the same rule: `allowed` (a mask over the whole vocabulary: the reference) and
`legal_ids` (each row's legal ids, in ascending order: what the sampler works on, so a row's
penalty, sort and draw span 4,097 columns, not 156,940), plus `span`, the contiguous range of ids that
holds every id a grammar may emit (the rows of the output head a step under it needs).
"""

from __future__ import annotations

from enum import IntEnum

import torch

from tandem.backend.generation import orpheus_ids as orpheus
from tandem.backend.generation.vocab_span import VocabSpan


class Grammar(IntEnum):
    NONE = 0  # every id of the vocabulary
    ORPHEUS = 1  # slot (i mod 7)'s 4,096 audio ids, or end-of-speech


GRAMMAR_NAMES = {"off": Grammar.NONE, "orpheus": Grammar.ORPHEUS}


def orpheus_audio_id(position: int, code: int) -> int:
    """The id of SNAC code `code` at audio position `position` (tests, codecs)."""
    if not 0 <= code < orpheus.CODES_PER_SLOT:
        raise ValueError(f"SNAC code {code} is outside [0, {orpheus.CODES_PER_SLOT})")
    return orpheus.AUDIO_BASE + (position % orpheus.SLOTS) * orpheus.CODES_PER_SLOT + code


def check_vocab(grammar: Grammar, vocab_size: int) -> None:
    """Raises ValueError when `grammar`'s ids do not fit a vocabulary of `vocab_size` (a model the
    grammar does not belong to); called at load time."""
    if grammar == Grammar.ORPHEUS and vocab_size < orpheus.AUDIO_END:
        raise ValueError(
            f"the orpheus grammar needs a vocabulary of >= {orpheus.AUDIO_END} ids, not {vocab_size}"
        )


def allowed(grammar: Grammar, audio_positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [N, vocab_size] on `audio_positions`' device: True where row n (at audio position
    audio_positions[n], int64 [N]) may sample that id. Nothing waits for the device.

    Raises ValueError when the grammar's ids do not fit the vocabulary (a model the grammar does
    not belong to)."""
    ids = torch.arange(vocab_size, device=audio_positions.device)[None, :]
    if grammar == Grammar.NONE:
        return torch.ones((audio_positions.shape[0], vocab_size), dtype=torch.bool, device=ids.device)
    if grammar == Grammar.ORPHEUS:
        check_vocab(grammar, vocab_size)
        lo = orpheus.AUDIO_BASE + (audio_positions % orpheus.SLOTS)[:, None] * orpheus.CODES_PER_SLOT
        return ((ids >= lo) & (ids < lo + orpheus.CODES_PER_SLOT)) | (ids == orpheus.END_OF_SPEECH)
    raise ValueError(f"unknown grammar {grammar!r}")


def span(grammar: Grammar, vocab_size: int) -> VocabSpan:
    """The contiguous ids that hold every id `grammar` may emit (the whole vocabulary for NONE).

    Orpheus: end-of-speech up to the last slot's last id, 28,680 ids: the 7 x 4,096 audio
    ids, end-of-speech and the 7 special ids between them (computed, never sampled). Raises
    ValueError when the grammar's ids do not fit the vocabulary."""
    check_vocab(grammar, vocab_size)
    if grammar == Grammar.NONE:
        return VocabSpan.whole(vocab_size)
    if grammar == Grammar.ORPHEUS:
        last = orpheus.AUDIO_END
        return VocabSpan(orpheus.END_OF_SPEECH, last, vocab_size)
    raise ValueError(f"unknown grammar {grammar!r}")


def legal_width(grammar: Grammar) -> int:
    """How many ids a row under `grammar` may sample at any position (Orpheus: 4,097)."""
    if grammar == Grammar.ORPHEUS:
        return orpheus.CODES_PER_SLOT + 1
    raise ValueError(f"grammar {grammar!r} does not restrict the vocabulary")


def legal_ids(grammar: Grammar, audio_positions: torch.Tensor) -> torch.Tensor:
    """int64 [N, legal_width(grammar)] on `audio_positions`' device: row n's legal ids at audio
    position audio_positions[n] (int64 [N]), ascending, so a stable sort over them breaks ties
    toward the lower id as one over the whole vocabulary does. Orpheus: end-of-speech, then slot
    (i mod 7)'s 4,096 ids. The ids `allowed` marks True, nothing else; nothing waits for the device."""
    if grammar == Grammar.ORPHEUS:
        dev = audio_positions.device
        lo = orpheus.AUDIO_BASE + (audio_positions % orpheus.SLOTS)[:, None] * orpheus.CODES_PER_SLOT
        codes = torch.arange(orpheus.CODES_PER_SLOT, dtype=torch.long, device=dev)[None, :]
        eos = torch.full((audio_positions.shape[0], 1), orpheus.END_OF_SPEECH, dtype=torch.long, device=dev)
        return torch.cat([eos, lo + codes], dim=1)
    raise ValueError(f"grammar {grammar!r} does not restrict the vocabulary")


def stop_ids(grammar: Grammar) -> tuple[int, ...]:
    """Ids that end a stream under `grammar` (on top of the checkpoint's eos ids)."""
    return (orpheus.END_OF_SPEECH,) if grammar == Grammar.ORPHEUS else ()
