"""The codec's configuration: which codec, its files, its token layout and context, and the reference
codec's clock. Parsed by `backend/settings.py` (sections `codec` and `vocoder`); read by the builder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class VocoderConfig:
    sample_rate: int = 22050
    rows_per_second: int = 21

    def __post_init__(self) -> None:
        if self.sample_rate % self.rows_per_second:
            raise ValueError("sample_rate must be a whole multiple of rows_per_second")

    @property
    def samples_per_row(self) -> int:
        return self.sample_rate // self.rows_per_second


@dataclass(frozen=True)
class CodecSettings:
    """The codec behind the vocoder seam (backend/codec/base.py, docs/codecs.md). D, the vocoder and the
    monolithic engine must agree on it: D frames the rows, the vocoder decodes the frames.

    kind: "reference" (ReferenceVocoder, no weights; `tandem.vocoder.*` sets its clock), "snac"
    (`path`: a directory with SNAC's config.json + pytorch_model.bin) or "mimi" (`path`: Mimi's
    config.json + model.safetensors). layout: how the LM's rows carry the codes ("" = the kind's
    own: reference -> rows, snac -> orpheus, mimi -> csm). lookback/lookahead_frames: context
    decoded around each chunk (-1 = the kind's default: reference 0/0, snac 2/1, mimi 8/0)."""

    kind: str = "reference"
    path: str = ""
    layout: str = ""
    lookback_frames: int = -1
    lookahead_frames: int = -1


def read_codec_dir(
    path: str | Path, codec: str, config_name: str, weights_name: str
) -> tuple[Path, dict[str, Any]]:
    """A codec directory as its package ships it (`tandem.codec.path`): it holds `config_name` and
    `weights_name`, and the config is a JSON object. (directory, config); raises ValueError naming what
    is missing or malformed. What each codec checks inside its config is its own."""
    directory = Path(path)
    if not str(path) or not directory.is_dir():
        raise ValueError(
            f"tandem.codec.path: {str(path)!r} is not a directory ({codec}'s {config_name}, {weights_name})"
        )
    for name in (config_name, weights_name):
        if not (directory / name).is_file():
            raise ValueError(f"tandem.codec.path: {directory} has no {name}")
    try:
        config = json.loads((directory / config_name).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"tandem.codec.path: cannot read {directory / config_name}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{directory / config_name}: not a JSON object")
    return directory, config
