"""OpenAI's model and voice names as the gateway's aliases, so OpenAI clients work as they are written.

A client written for OpenAI sends `model="tts-1"` and `voice="alloy"`; no tandem model or voice has
those names. The gateway maps them before anything reaches the unit:

- Models: `tts-1`, `tts-1-hd` and `gpt-4o-mini-tts` name the default model, the first of
  `tandem-gateway --models` (`tts` by default). A served model's own name always wins.
- Voices: OpenAI's voice names in `OPENAI_VOICES`' order (alloy, ash, ballad, coral, echo, fable,
  nova, onyx, sage, shimmer, verse) name the served model's built-in voices in their configured
  order (`tandem.frontend.voices`), the i-th OpenAI name the i-th built-in voice, round again when
  the model has fewer (Orpheus: alloy -> tara, ash -> leah, ... sage -> tara). A model's own
  built-in voice name always wins; a model with no built-in voice list maps nothing.

`tandem-gateway --aliases FILE` replaces the defaults: a JSON object with `models` (alias -> served
model) and `voices` (alias -> a voice name the unit knows, built-in or registered), each optional;
unknown keys are refused. Registering a voice under an alias name is refused (it would never be
spoken), so an alias never hides a registered voice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
)
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
DEFAULT = ""  # a model alias's target meaning "the default model" (the first served)


@dataclass(frozen=True)
class Aliases:
    """Alias tables. `voices` empty: OpenAI's voice names map by position (`voice`)."""

    models: Mapping[str, str] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(OPENAI_MODELS, DEFAULT))
    )
    voices: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_file(cls, path: str | Path) -> Aliases:
        """The tables of a JSON file (module docstring); ValueError saying what is wrong otherwise."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"aliases file {path}: {exc}") from None
        if not isinstance(data, dict) or set(data) - {"models", "voices"}:
            raise ValueError(f"aliases file {path}: a JSON object with `models` and/or `voices` only")
        tables: dict[str, dict[str, str]] = {}
        for key in ("models", "voices"):
            table = data.get(key, {})
            if not isinstance(table, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in table.items()
            ):
                raise ValueError(f"aliases file {path}: `{key}` must map names to names (strings)")
            tables[key] = table
        return cls(MappingProxyType(tables["models"]), MappingProxyType(tables["voices"]))

    def model(self, name: str, served: Sequence[str]) -> str:
        """The served model `name` stands for (`name` itself when served or not an alias)."""
        if name in served or name not in self.models:
            return name
        target = self.models[name]
        return target if target != DEFAULT else (served[0] if served else name)

    def voice(self, name: str, builtin: Sequence[str]) -> str:
        """The voice `name` stands for on a model with `builtin` voices (`name` itself when it is one
        of them or not an alias)."""
        if name in builtin:
            return name
        if self.voices:
            return self.voices.get(name, name)
        if name in OPENAI_VOICES and builtin:
            return builtin[OPENAI_VOICES.index(name) % len(builtin)]
        return name

    def is_voice_alias(self, name: str) -> bool:
        return name in (self.voices or OPENAI_VOICES)
