"""The text front end: a request's TEXT (and VOICE) become the prompt rows the LM was trained on.

Called on Triton's execute thread (microseconds, no device) by the `frontend` step of `tts` and by
`tts_mono`, both through `serving/triton_io.py`, so equal requests give equal rows on both.

A family is a prompt template, from the checkpoint (`detect_family`) or `tandem.frontend.family`:
- `orpheus` (canopyai/Orpheus-TTS, `_format_prompt`): ``[START_OF_HUMAN] + encode(f"{voice}: {text}") +
  [END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH]`` (BOS inside `encode`; the ids:
  `backend/generation/orpheus_ids.py`); without a voice the text alone.
- `plain`: ``encode(f"{voice}: {text}")`` (or the text alone), each token in column 0 of a W-wide row.
- `csm` (Sesame CSM, `backend/text/csm.py`): the segment ``<|begin_of_text|>[speaker]text<|end_of_text|>``
  (the tokenizer's own begin/end tokens where its post-processor adds them, else added here), one
  text row each, the codebook columns absent (-1); VOICE is a speaker number ("" is speaker 0), or
  a registered voice: its transcript's segment, its Mimi frames and the end frame as the context
  utterance (speaker 0), then the text as speaker 0's.

A VOICE is a built-in voice (`tandem.frontend.voices`, else the checkpoint's `tandem_voices`; `*`:
any name), or a registered one (`backend/voices/store.py`, read per request), whose prompt is its
cloning prefix (`cloning.py`) and then the text without a voice name. Anything else is refused.

Failure: a bad TEXT or VOICE is `InvalidInput` naming it; a tokenizer that cannot serve the model is
a load-time ValueError.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path

import numpy as np

from tandem.backend.codec.csm import CODEBOOK_EOS
from tandem.backend.errors import InvalidInput
from tandem.backend.generation import orpheus_ids as orpheus
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.model.csm import ABSENT, CsmRows
from tandem.backend.model.csm_checkpoint import csm_shape
from tandem.backend.prompt import TextRequest
from tandem.backend.settings import EngineSettings, Limits
from tandem.backend.text.cloning import orpheus_prefix, plain_prefix
from tandem.backend.text.csm import Utterance, prompt_rows, speaker_text
from tandem.backend.text.families import checkpoint_config
from tandem.backend.text.tokenizer import TextTokenizer
from tandem.backend.voices.store import VoiceRecord, VoiceStore


class Family(IntEnum):
    PLAIN = 0
    ORPHEUS = 1
    CSM = 2


FAMILY_NAMES = {"plain": Family.PLAIN, "orpheus": Family.ORPHEUS, "csm": Family.CSM}
CSM_BEGIN_OF_TEXT = "<|begin_of_text|>"
CSM_END_OF_TEXT = "<|end_of_text|>"

# Orpheus' prompt template around the text (`backend/generation/orpheus_ids.py`).
ORPHEUS_PREFIX = (orpheus.START_OF_HUMAN,)
ORPHEUS_SUFFIX = (orpheus.END_OF_TEXT, orpheus.END_OF_HUMAN, orpheus.START_OF_AI, orpheus.START_OF_SPEECH)
ANY_VOICE = "*"  # `tandem.frontend.voices`: every name is a built-in voice


def detect_family(tokenizer: TextTokenizer, cfg: ModelConfig) -> Family:
    """CSM when the model's rows carry a text column (`ModelConfig.text_vocab_size`, a CSM
    checkpoint's backbone); ORPHEUS when the tokenizer has Orpheus' custom tokens at their ids and the
    model (one id per row) has room for its audio ids; PLAIN otherwise."""
    if cfg.text_vocab_size:
        return Family.CSM
    custom = all(
        tokenizer.token_id(f"<custom_token_{n}>") == orpheus.CUSTOM_TOKEN_BASE + n for n in (1, 2, 3, 4, 5)
    )
    if custom and cfg.row_width == 1 and cfg.vocab_size >= orpheus.AUDIO_END:
        return Family.ORPHEUS
    return Family.PLAIN


def parse_family(name: str, tokenizer: TextTokenizer, cfg: ModelConfig) -> Family:
    """`tandem.frontend.family`: "auto" (detect), "plain", "orpheus" or "csm"; ValueError for anything
    else."""
    if name == "auto":
        return detect_family(tokenizer, cfg)
    try:
        return FAMILY_NAMES[name]
    except KeyError:
        raise ValueError(
            f"unknown tandem.frontend.family {name!r}; expected auto, {', '.join(FAMILY_NAMES)}"
        ) from None


class TextFrontend:
    """Text -> prompt rows for one model. Built once per model instance; `rows` may be called from
    any thread (the tokenizer is thread-safe and nothing here is mutable)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        family: Family,
        cfg: ModelConfig,
        limits: Limits,
        voices: Sequence[str] = (ANY_VOICE,),
        max_text_bytes: int = 4096,
        store: VoiceStore | None = None,
        codebook_eos: int = CODEBOOK_EOS,
    ) -> None:
        """`codebook_eos`: CSM's end-frame code (its checkpoint's; a voice's context closes with it).
        Raises ValueError when the tokenizer cannot serve `cfg` (ids past its vocabulary, a
        template token missing) or a family does not fit the model (Orpheus needs one id per row)."""
        if max_text_bytes < 1:
            raise ValueError(f"tandem.frontend.max_text_bytes must be >= 1, got {max_text_bytes}")
        text_vocab = cfg.text_vocab_size or cfg.vocab_size  # CSM: its text column's vocabulary
        if tokenizer.vocab_size > text_vocab:
            raise ValueError(
                f"tokenizer {tokenizer.source} makes ids up to {tokenizer.vocab_size - 1}, past the model's "
                f"{'text ' if cfg.text_vocab_size else ''}vocabulary of {text_vocab}"
            )
        self._csm_ends: tuple[int, int] | None = None
        self.codebook_eos = codebook_eos
        if (family == Family.CSM) != bool(cfg.text_vocab_size):
            raise ValueError("the csm template serves a CSM checkpoint (rows of codes + a text column) only")
        if family == Family.CSM:
            bot, eot = tokenizer.token_id(CSM_BEGIN_OF_TEXT), tokenizer.token_id(CSM_END_OF_TEXT)
            if bot is None or eot is None:
                raise ValueError(
                    f"the csm template needs {CSM_BEGIN_OF_TEXT} and {CSM_END_OF_TEXT} in {tokenizer.source}"
                )
            self._csm_ends = (bot, eot)
        if family == Family.ORPHEUS:
            if cfg.row_width != 1:
                raise ValueError(
                    f"the orpheus template needs rows of one id; the model's are {cfg.row_width}"
                )
            needed = (*ORPHEUS_PREFIX, *ORPHEUS_SUFFIX)
            if max(needed) >= cfg.vocab_size:
                raise ValueError(f"the orpheus template uses id {max(needed)}, past the model's vocabulary")
        self.tokenizer = tokenizer
        self.family = family
        self.cfg = cfg
        self.limits = limits
        self.voices = tuple(voices)  # built-in; (ANY_VOICE,) takes any name
        self.max_text_bytes = max_text_bytes
        self.store = store
        self._prefixes: dict[str, tuple[VoiceRecord, np.ndarray]] = {}
        self._lock = threading.Lock()

    def check_voice(self, voice: str) -> VoiceRecord | None:
        """None for no voice or a built-in one; the record of a registered one (which wins over
        `*`, never over a listed name: registration refuses those); else InvalidInput naming VOICE
        and listing the voices there are."""
        if not voice or voice in self.voices or (self.family == Family.CSM and voice.isdigit()):
            return None  # CSM: a speaker number is a built-in voice
        record = self.store.get(voice) if self.store is not None else None
        if record is None:
            with self._lock:
                self._prefixes.pop(voice, None)  # deleted: its prefix goes too
        if record is not None or ANY_VOICE in self.voices:
            return record
        # Only the built-in voices and those of the caller's namespace (a tenant's, `SPACE.NAME`),
        # named as the caller names them: another tenant's voices are none of its business.
        space, dot, own = voice.rpartition(".")
        registered = [n.rpartition(".") for n in (self.store.names() if self.store else [])]
        mine = [n for s, d, n in registered if (s, d) == (space, dot)]
        speakers = ["a speaker number (0, 1, ...)"] if self.family == Family.CSM else []
        there = ", ".join([*self.voices, *speakers, *mine]) or "none"
        raise InvalidInput(f"VOICE {own!r} is not one of this model's voices: {there}")

    def _text_ids(self, text: str, voice: str = "") -> list[int]:
        if self._csm_ends is not None:
            return self._csm_ids(text, voice)
        ids = self.tokenizer.encode(f"{voice}: {text}" if voice else text)
        if self.family == Family.ORPHEUS:
            return [*ORPHEUS_PREFIX, *ids, *ORPHEUS_SUFFIX]
        return ids

    def _csm_ids(self, text: str, voice: str) -> list[int]:
        """CSM's segment: begin-of-text, ``[speaker]text``, end-of-text (module docstring)."""
        assert self._csm_ends is not None
        if voice and not voice.isdigit():
            raise InvalidInput(f"VOICE {voice!r}: a CSM speaker is a number (0, 1, ...)")
        bot, eot = self._csm_ends
        ids = self.tokenizer.encode(speaker_text(int(voice or 0), text))
        return [*([] if ids[:1] == [bot] else [bot]), *ids, *([] if ids[-1:] == [eot] else [eot])]

    def _csm_prefix(self, record: VoiceRecord) -> np.ndarray:
        """A registered voice as CSM's context utterance (speaker 0, as the text to speak then is):
        its transcript's segment, its Mimi frames, the end frame (`backend/text/csm.py`)."""
        n = self.cfg.row_width - 1
        frames = np.asarray(record.frames, dtype=np.int64)
        if frames.ndim != 2 or frames.shape[1] != n:
            raise InvalidInput(
                f"VOICE {record.name!r} was registered with {record.codec} frames of {record.frame_width} "
                f"codes; this model's are {n} Mimi codes"
            )
        rows = CsmRows(n, self.cfg.vocab_size, self.cfg.text_vocab_size)
        segment = np.asarray(self._csm_ids(record.transcript, "0"), dtype=np.int64)
        try:
            return prompt_rows([Utterance(segment, frames)], rows, self.codebook_eos)
        except ValueError as exc:
            raise InvalidInput(f"VOICE {record.name!r}: {exc}") from None

    def ids(self, request: TextRequest) -> list[int]:
        """The family's prompt ids for `request` with a built-in voice or none (one per row)."""
        if self.check_voice(request.voice) is not None:
            raise ValueError("ids() serves built-in voices; rows() also serves registered ones")
        return self._text_ids(request.text, request.voice)

    def prefix(self, record: VoiceRecord) -> np.ndarray:
        """The cloning prefix rows (int64 [P, W]) of a registered voice, built once per stored
        version of it (a re-registered voice is a new record)."""
        with self._lock:
            hit = self._prefixes.get(record.name)
        if hit is not None and hit[0] is record:
            return hit[1]
        if self.family == Family.CSM:
            rows = self._csm_prefix(record)
        elif self.family == Family.ORPHEUS:
            rows = orpheus_prefix(self.tokenizer, record).reshape(-1, 1)
        else:
            rows = plain_prefix(self.tokenizer, record, self.cfg)
        with self._lock:
            self._prefixes[record.name] = (record, rows)
        return rows

    def rows(self, request: TextRequest) -> np.ndarray:
        """int64 [N, W] prompt rows (C-contiguous; the caller owns them). Raises InvalidInput for an
        unknown voice, text that makes no token, or more rows than `limits.max_prompt_rows`."""
        record = self.check_voice(request.voice)
        ids = self._text_ids(request.text, request.voice if record is None else "")
        if not ids:
            raise InvalidInput("TEXT makes no token")
        head = self.prefix(record) if record is not None else np.zeros((0, self.cfg.row_width), np.int64)
        total = head.shape[0] + len(ids)
        if total > self.limits.max_prompt_rows:
            voice = f" with the {head.shape[0]}-row prefix of VOICE {request.voice!r}" if record else ""
            raise InvalidInput(
                f"TEXT makes {total} prompt rows{voice}; the limit is {self.limits.max_prompt_rows}"
            )
        out = np.zeros((total, self.cfg.row_width), dtype=np.int64)
        out[: head.shape[0]] = head
        if self.family == Family.CSM:  # a text row: the text column only, the codes absent
            out[head.shape[0] :] = ABSENT
            out[head.shape[0] :, -1] = ids
        else:
            out[head.shape[0] :, 0] = ids
        return out


def model_config(settings: EngineSettings) -> ModelConfig:
    """The served model's config without its weights (the `frontend` step loads none): the
    checkpoint's config.json (a CSM's backbone, `families.checkpoint_config`), else the preset."""
    if settings.model.checkpoint:
        return checkpoint_config(Path(settings.model.checkpoint))
    return preset(settings.model.preset)


def _checkpoint_voices(checkpoint: str) -> tuple[str, ...]:
    if not checkpoint:
        return ()
    voices = json.loads((Path(checkpoint) / "config.json").read_text()).get("tandem_voices") or []
    if not isinstance(voices, list) or not all(isinstance(v, str) and v for v in voices):
        raise ValueError(f"{checkpoint}/config.json: tandem_voices must be a list of non-empty names")
    return tuple(voices)


def builtin_voices(settings: EngineSettings) -> tuple[str, ...]:
    """The model's built-in voices: `tandem.frontend.voices`, else the checkpoint's `tandem_voices`."""
    listed = tuple(v.strip() for v in settings.frontend.voices.split(",") if v.strip())
    return listed or _checkpoint_voices(settings.model.checkpoint)


def build_frontend(
    settings: EngineSettings, cfg: ModelConfig, model_dir: str | Path, store: VoiceStore | None = None
) -> TextFrontend | None:
    """The model's text front end from its settings, or None when it has no tokenizer (it then
    refuses TEXT). `model_dir` anchors a relative `tandem.frontend.tokenizer`; `store`: the
    registered voices it may speak with. Called once by the `frontend` and `tts_mono` adapters at
    start-up; raises ValueError (load failure) when the tokenizer or the family does not fit the
    model."""
    fs = settings.frontend
    checkpoint = settings.model.checkpoint
    if fs.tokenizer:
        path = Path(fs.tokenizer)
        if not path.is_absolute():
            path = Path(model_dir) / path
    elif checkpoint and (Path(checkpoint) / "tokenizer.json").is_file():
        path = Path(checkpoint) / "tokenizer.json"
    else:
        return None
    tokenizer = TextTokenizer.load(path)
    family = parse_family(fs.family, tokenizer, cfg)
    voices = builtin_voices(settings)
    eos = CODEBOOK_EOS
    if checkpoint and family == Family.CSM:
        eos = csm_shape(json.loads((Path(checkpoint) / "config.json").read_text())).codebook_eos
    return TextFrontend(tokenizer, family, cfg, settings.limits, voices, fs.max_text_bytes, store, eos)
