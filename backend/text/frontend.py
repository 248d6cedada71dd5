"""The text front end: a request's TEXT (and VOICE) become the prompt rows the LM was trained on.

Who calls it: the `frontend` step of the `tts` ensemble (before `prefill`) and `tts_mono` (before its
engine), both through `serving/triton_io.py`, so equal requests give equal rows on both models. It
runs on Triton's execute thread: tokenizing a sentence takes microseconds and allocates nothing on a
device.

A family is a prompt template. Which one applies comes from the checkpoint (its tokenizer and config,
`detect_family`) or the setting `tandem.frontend.family`:

- `orpheus` (canopyai/Orpheus-TTS, `orpheus_tts/engine_class.py`, `_format_prompt`):
  ``[128259] + encode(f"{voice}: {text}") + [128009, 128260, 128261, 128257]`` with the tokenizer's
  own BOS inside `encode`; without a voice the text alone. 128259 starts the human turn, 128009 is
  Llama 3's end of turn, 128260/128261 end the human turn and start the model's, 128257 starts speech.
- `plain`: ``encode(f"{voice}: {text}")`` (or the text alone); on a model whose rows are W ids wide
  each token fills column 0 and the other columns are 0. For models without a template of their
  own, the CPU default's tiny model among them.

Every problem with a request's text is `InvalidInput` naming it; a tokenizer that cannot serve the
model (ids past its vocabulary, a template token it lacks) is a load-time ValueError.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path

import numpy as np

from tandem.backend.errors import InvalidInput
from tandem.backend.model.checkpoint import config_from_hf
from tandem.backend.model.config import ModelConfig, preset
from tandem.backend.prompt import TextRequest
from tandem.backend.settings import EngineSettings, Limits
from tandem.backend.text.tokenizer import TextTokenizer


class Family(IntEnum):
    PLAIN = 0
    ORPHEUS = 1


FAMILY_NAMES = {"plain": Family.PLAIN, "orpheus": Family.ORPHEUS}

# Orpheus' prompt tokens: `<custom_token_N>` is id 128256 + N in its tokenizer.
ORPHEUS_CUSTOM_BASE = 128256
ORPHEUS_START_OF_HUMAN = 128259  # <custom_token_3>
ORPHEUS_END_OF_TEXT = 128009  # <|eot_id|>
ORPHEUS_END_OF_HUMAN = 128260  # <custom_token_4>
ORPHEUS_START_OF_AI = 128261  # <custom_token_5>
ORPHEUS_START_OF_SPEECH = 128257  # <custom_token_1>
ORPHEUS_PREFIX = (ORPHEUS_START_OF_HUMAN,)
ORPHEUS_SUFFIX = (ORPHEUS_END_OF_TEXT, ORPHEUS_END_OF_HUMAN, ORPHEUS_START_OF_AI, ORPHEUS_START_OF_SPEECH)
# Orpheus' audio ids end at 128266 + 7 * 4096 (backend/generation/grammar.py): a model whose vocabulary holds
# them and whose tokenizer names the custom tokens at their ids is an Orpheus checkpoint.
ORPHEUS_MIN_VOCAB = 128266 + 7 * 4096


def detect_family(tokenizer: TextTokenizer, cfg: ModelConfig) -> Family:
    """ORPHEUS when the tokenizer has Orpheus' custom tokens at their ids and the model (one id per
    row) has room for its audio ids; PLAIN otherwise."""
    custom = all(
        tokenizer.token_id(f"<custom_token_{n}>") == ORPHEUS_CUSTOM_BASE + n for n in (1, 2, 3, 4, 5)
    )
    if custom and cfg.row_width == 1 and cfg.vocab_size >= ORPHEUS_MIN_VOCAB:
        return Family.ORPHEUS
    return Family.PLAIN


def parse_family(name: str, tokenizer: TextTokenizer, cfg: ModelConfig) -> Family:
    """`tandem.frontend.family`: "auto" (detect), "plain" or "orpheus"; ValueError for anything else."""
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
        voices: Sequence[str] = (),
        max_text_bytes: int = 4096,
    ) -> None:
        """Raises ValueError when the tokenizer cannot serve `cfg` (ids past its vocabulary, a
        template token missing) or a family does not fit the model (Orpheus needs one id per row)."""
        if max_text_bytes < 1:
            raise ValueError(f"tandem.frontend.max_text_bytes must be >= 1, got {max_text_bytes}")
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer.source} makes ids up to {tokenizer.vocab_size - 1}, past the model's "
                f"vocabulary of {cfg.vocab_size}"
            )
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
        self.voices = tuple(voices)
        self.max_text_bytes = max_text_bytes

    def check_voice(self, voice: str) -> None:
        if voice and self.voices and voice not in self.voices:
            raise InvalidInput(f"VOICE {voice!r} is not one of this model's voices: {', '.join(self.voices)}")

    def ids(self, request: TextRequest) -> list[int]:
        """The family's prompt ids for `request` (one per row)."""
        self.check_voice(request.voice)
        spoken = f"{request.voice}: {request.text}" if request.voice else request.text
        ids = self.tokenizer.encode(spoken)
        if self.family == Family.ORPHEUS:
            return [*ORPHEUS_PREFIX, *ids, *ORPHEUS_SUFFIX]
        return ids

    def rows(self, request: TextRequest) -> np.ndarray:
        """int64 [N, W] prompt rows (C-contiguous; the caller owns them). Raises InvalidInput for an
        unknown voice, text that makes no token, or more rows than `limits.max_prompt_rows`."""
        ids = self.ids(request)
        if not ids:
            raise InvalidInput("TEXT makes no token")
        if len(ids) > self.limits.max_prompt_rows:
            raise InvalidInput(
                f"TEXT makes {len(ids)} prompt rows; the limit is {self.limits.max_prompt_rows}"
            )
        out = np.zeros((len(ids), self.cfg.row_width), dtype=np.int64)
        out[:, 0] = ids
        return out


def model_config(settings: EngineSettings) -> ModelConfig:
    """The served model's config without its weights (the `frontend` step loads none): the
    checkpoint's config.json, else the preset."""
    if settings.model.checkpoint:
        return config_from_hf(json.loads((Path(settings.model.checkpoint) / "config.json").read_text()))
    return preset(settings.model.preset)


def _checkpoint_voices(checkpoint: str) -> tuple[str, ...]:
    if not checkpoint:
        return ()
    voices = json.loads((Path(checkpoint) / "config.json").read_text()).get("tandem_voices") or []
    if not isinstance(voices, list) or not all(isinstance(v, str) and v for v in voices):
        raise ValueError(f"{checkpoint}/config.json: tandem_voices must be a list of non-empty names")
    return tuple(voices)


def build_frontend(settings: EngineSettings, cfg: ModelConfig, model_dir: str | Path) -> TextFrontend | None:
    """The model's text front end from its settings, or None when it has no tokenizer (it then
    refuses TEXT). `model_dir` anchors a relative `tandem.frontend.tokenizer`. Called once by the
    `frontend` and `tts_mono` adapters at start-up; raises ValueError (load failure) when the tokenizer
    or the family does not fit the model."""
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
    voices = tuple(v.strip() for v in fs.voices.split(",") if v.strip()) or _checkpoint_voices(checkpoint)
    family = parse_family(fs.family, tokenizer, cfg)
    return TextFrontend(tokenizer, family, cfg, settings.limits, voices, fs.max_text_bytes)
