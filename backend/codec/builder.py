"""One builder from typed settings to the codec: its spec (no weights), D's framing, the codec itself.

`tandem.codec.kind` picks it (`CodecSettings`, backend/codec/config.py):
- `reference`: `ReferenceVocoder` (tones, no weights), one frame per row, no context; its clock is
  `tandem.vocoder.sample_rate` / `rows_per_second`. The checked-in CPU default.
- `snac`: SNAC from `tandem.codec.path` (backend/codec/snac.py), Orpheus' layout by default.
- `mimi`: Mimi from `tandem.codec.path` through `transformers.MimiModel` (backend/codec/mimi.py),
  CSM's layout by default (backend/codec/csm.py): causal, so no lookahead; 8 frames of lookback.
No import side effects and no environment reads: every process (P, D, the vocoder, the monolithic
engine) builds the same spec from the same parameters.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tandem.backend.codec.base import AudioLayout, Codec, CodecSpec, Encoder, Framing, RowLayout
from tandem.backend.codec.config import CodecSettings, VocoderConfig
from tandem.backend.codec.csm import CsmLayout
from tandem.backend.codec.orpheus import OrpheusLayout

KINDS = ("reference", "snac", "mimi")


class CodecConfigured(Protocol):
    """What the builder reads of an engine's settings (`EngineSettings` is one)."""

    @property
    def codec(self) -> CodecSettings: ...

    @property
    def vocoder(self) -> VocoderConfig: ...


LAYOUTS: dict[str, type[RowLayout] | type[OrpheusLayout] | type[CsmLayout]] = {
    "rows": RowLayout,
    "orpheus": OrpheusLayout,
    "csm": CsmLayout,
}
# layout, lookback, lookahead
_DEFAULTS = {"reference": ("rows", 0, 0), "snac": ("orpheus", 2, 1), "mimi": ("csm", 8, 0)}


def layout(name: str) -> AudioLayout:
    try:
        return LAYOUTS[name]()
    except KeyError:
        known = sorted(LAYOUTS)
        raise ValueError(f"parameter 'codec.layout': unknown layout {name!r}; known: {known}") from None


def codec_spec(settings: CodecConfigured) -> CodecSpec:
    """The configured codec's spec; raises ValueError naming the bad parameter (kind, path, layout)."""
    c = settings.codec
    if c.kind not in KINDS:
        raise ValueError(f"parameter 'codec.kind': unknown codec {c.kind!r}; known: {list(KINDS)}")
    default_layout, default_back, default_ahead = _DEFAULTS[c.kind]
    name = c.layout or default_layout
    rows_per_frame = layout(name).rows_per_frame
    back = default_back if c.lookback_frames < 0 else c.lookback_frames
    ahead = default_ahead if c.lookahead_frames < 0 else c.lookahead_frames
    if c.kind == "reference":
        v = settings.vocoder
        return CodecSpec("reference", name, v.sample_rate, v.samples_per_row, rows_per_frame, back, ahead)
    if c.kind == "mimi":
        from tandem.backend.codec.mimi import mimi_spec

        return mimi_spec(c.path, name, back, ahead, rows_per_frame)
    from tandem.backend.codec.snac import snac_spec

    return snac_spec(c.path, name, back, ahead, rows_per_frame)


def framing(settings: CodecConfigured) -> Framing:
    """D's (and the monolithic engine's) side of the codec: layout and context frames."""
    spec = codec_spec(settings)
    return Framing(layout(spec.layout), spec.lookback, spec.lookahead)


def build_codec(settings: CodecConfigured, device: torch.device) -> Codec:
    """The codec itself, on `device` (SNAC loads its weights here; the reference codec has none)."""
    spec = codec_spec(settings)
    if spec.kind == "reference":
        from tandem.backend.codec.reference import ReferenceVocoder

        return ReferenceVocoder(settings.vocoder)
    if spec.kind == "mimi":
        from tandem.backend.codec.mimi import MimiCodec

        return MimiCodec(settings.codec.path, spec, device)
    from tandem.backend.codec.snac import SnacCodec

    return SnacCodec(settings.codec.path, spec, device)


def build_encoder(settings: CodecConfigured, device: torch.device) -> Encoder:
    """The codec's encoder, on `device`, for registering voices (every codec encodes: SNAC and Mimi
    with their own encoders, the reference codec by analysing its tones)."""
    spec = codec_spec(settings)
    if spec.kind == "reference":
        from tandem.backend.codec.reference import ReferenceVocoder

        return ReferenceVocoder(settings.vocoder)
    if spec.kind == "mimi":
        from tandem.backend.codec.mimi import MimiCodec

        return MimiCodec(settings.codec.path, spec, device)
    from tandem.backend.codec.snac import SnacCodec

    return SnacCodec(settings.codec.path, spec, device)
