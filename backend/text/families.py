"""Model families `tandem-repo` knows, how it recognises one from a checkpoint directory, and what a
family's repository carries by default (its codec, its built-in voices, a request's default length).

A family fixes the codec the LM drives and how its tokens carry the codes (backend/codec/builder.py).
Recognised from the checkpoint's files, never its directory name, or implied by a preset of the
family's shape (`PRESET_FAMILIES`: random weights with no tokenizer, so nothing else could tell):
- orpheus: a Llama with the Llama-3 text vocabulary plus 7 x 4096 audio tokens (156,940 ids), whose
  tokenizer, when shipped, names id 128266 `<custom_token_10>`.
- csm: Sesame CSM (config.json model_type `csm`: a backbone and a depth decoder over Mimi frames,
  backend/model/csm.py), whose codec is Mimi. Its decoder config is the backbone's
  (`checkpoint_config`): rows of N codes plus a text column.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.backend.generation import orpheus_ids as orpheus
from tandem.backend.model.checkpoint import config_from_hf
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.csm_checkpoint import MODEL_TYPE as CSM_MODEL_TYPE
from tandem.backend.model.csm_checkpoint import check_codec, csm_shape

FAMILIES = {
    "orpheus": "SNAC 24 kHz: the hubertsiuzdak/snac_24khz directory",
    "csm": "Mimi: the kyutai/mimi directory (config.json + model.safetensors)",
}
# The codec each family's LM drives: (tandem.codec.kind, tandem.codec.layout).
FAMILY_CODECS = {"orpheus": ("snac", "orpheus"), "csm": ("mimi", "csm")}
# The presets (backend/model/config.py) that stand for a family's model: a repository of one is that
# family's (its codec, its grammar), as a checkpoint of it would be.
PRESET_FAMILIES = {"orpheus-3b-shape": "orpheus"}
# The voices of a family's fine-tuned checkpoint (canopyai/Orpheus-TTS, orpheus-3b-0.1-ft), which its
# config.json does not list.
FAMILY_VOICES = {"orpheus": "tara,leah,jess,leo,dan,mia,zac,zoe"}
# A request's length when it names none (the OpenAI body never does): Orpheus' own engine asks for
# 1,200 tokens (14.6 s of audio), Sesame's generator for 90 s of audio (1,125 frames at 12.5/s).
FAMILY_DEFAULT_ROWS = {"orpheus": 1200, "csm": 1125}


def _tokenizer_names_audio_base(path: Path) -> bool | None:
    """True/False when `tokenizer.json` says what id 128266 is; None without a tokenizer."""
    tok = path / "tokenizer.json"
    if not tok.is_file():
        return None
    try:
        data = json.loads(tok.read_text())
    except (OSError, ValueError):
        return False
    added = {t.get("id"): t.get("content") for t in data.get("added_tokens", [])}
    vocab = data.get("model", {}).get("vocab", {})
    base = orpheus.AUDIO_BASE
    name = added.get(base) or next((k for k, v in vocab.items() if v == base), None)
    return name == f"<custom_token_{base - orpheus.CUSTOM_TOKEN_BASE}>"


def detect_family(checkpoint: Path) -> str | None:
    """The family of the checkpoint in `checkpoint` (its config.json and tokenizer.json), or None."""
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if config.get("model_type") == CSM_MODEL_TYPE:
        return "csm"
    vocab = int(config.get("vocab_size", 0))
    if config.get("model_type") != "llama" or vocab < orpheus.AUDIO_END:
        return None
    named = _tokenizer_names_audio_base(checkpoint)
    if named is None:
        return "orpheus" if vocab == orpheus.VOCAB_SIZE else None
    return "orpheus" if named else None


def resolve_family(named: str | None, checkpoint: Path | None, preset: str | None) -> str | None:
    """The family a repository serves: the one `named`, else the checkpoint's (`detect_family`),
    else the preset's (`PRESET_FAMILIES`); None for a model of no family."""
    if named:
        return named
    if checkpoint is not None:
        return detect_family(checkpoint)
    return PRESET_FAMILIES.get(preset or "")


def checkpoint_config(checkpoint: Path) -> ModelConfig:
    """The decoder config of the checkpoint in `checkpoint` (its config.json only): a CSM's backbone
    (its parts checked, `csm_shape`), else the plain HF decoder's. ValueError names a bad field."""
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("model_type") == CSM_MODEL_TYPE:
        return csm_shape(config).backbone
    return config_from_hf(config)


def check_csm_codec(checkpoint: Path, codec: Path) -> None:
    """ValueError naming the field when the Mimi in `codec` cannot decode the CSM in `checkpoint`'s
    frames (`check_codec`)."""
    shape = csm_shape(json.loads((checkpoint / "config.json").read_text()))
    check_codec(shape, json.loads((codec / "config.json").read_text()), f"{codec / 'config.json'}")
