"""Load a Sesame CSM checkpoint as it ships (`CsmForConditionalGeneration.save_pretrained`) into the
project's two decoders (backend/model/csm.py).

`config.json` (model_type `csm`) holds the backbone's Llama fields at its top level, the depth
decoder's in `depth_decoder_config` and Mimi's in `codec_config`; the safetensors hold
`backbone_model.*`, `embed_text_tokens`, `lm_head`, `depth_decoder.*` and `codec_model.*` (Mimi's
weights, which the codec loads from its own directory: backend/codec/mimi.py). With
`tie_codebooks_embeddings` the codebook table is stored once (under either part's name) and the two
decoders share one tensor. A config whose parts do not fit together, or a tensor of the wrong shape,
is a ValueError naming the field or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tandem.backend.model.checkpoint import config_from_hf, shard_files
from tandem.backend.model.config import ModelConfig, torch_dtype
from tandem.backend.model.csm import CsmBackbone, CsmDepth, CsmRows

MODEL_TYPE = "csm"
_CODEC_PREFIX = "codec_model."
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "audio_tokens_offsets")
# Checkpoint name prefix -> (part, the part's own parameter prefix).
_RENAMES = (
    ("backbone_model.embed_tokens.embed_audio_tokens.", "backbone", "model.embed_tokens.audio."),
    ("embed_text_tokens.", "backbone", "model.embed_tokens.text."),
    ("backbone_model.", "backbone", "model."),
    ("lm_head.", "backbone", "lm_head."),
    ("depth_decoder.model.embed_tokens.", "depth", "model.embed_tokens.table."),
    ("depth_decoder.model.inputs_embeds_projector.", "depth", "model.embed_tokens.projector."),
    ("depth_decoder.model.", "depth", "model."),
    ("depth_decoder.codebooks_head.weight", "depth", "codebooks_head"),
)
_TABLES = ("backbone_model.embed_tokens.embed_audio_tokens.weight", "depth_decoder.model.embed_tokens.weight")


@dataclass(frozen=True)
class CsmShape:
    """What a CSM config.json says, checked: both decoders' shapes, the rows, CSM's special ids."""

    backbone: ModelConfig
    depth: ModelConfig
    rows: CsmRows
    tied_tables: bool
    codebook_eos: int  # a frame whose codebooks 0..N-2 all hold it ends the speech (transformers' rule)
    codebook_pad: int
    audio_token: int  # the text id transformers puts where an audio frame goes (not a row of ours)
    audio_eos_token: int
    codec: dict[str, Any]  # Mimi's config as the checkpoint names it ({} when absent)

    @property
    def mimi_codes(self) -> int | None:
        """The ids a served frame samples among (0..this-1): Mimi's codebook size from `codec`, with
        the codebook eos id inside; None when the checkpoint names no codec (the whole vocabulary)."""
        size = self.codec.get("codebook_size")
        if not isinstance(size, int) or size < 1:
            return None
        return min(self.rows.codebook_vocab, max(size, self.codebook_eos + 1))


def _int(cfg: dict[str, Any], field: str, where: str) -> int:
    value = cfg.get(field)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}: field {field!r} must be an integer, got {value!r}")
    return value


def _part(hf: dict[str, Any], where: str, **override: Any) -> ModelConfig:
    try:
        return config_from_hf({**hf, "model_type": "llama", "tie_word_embeddings": False, **override})
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def csm_shape(hf: dict[str, Any], dtype: str | None = None) -> CsmShape:
    """Translate and check a CSM `config.json` dict; ValueError naming the field that is wrong."""
    if hf.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r}")
    depth_hf = hf.get("depth_decoder_config")
    if not isinstance(depth_hf, dict):
        raise ValueError("config.json: field 'depth_decoder_config' is missing (CSM's depth decoder)")
    n = _int(hf, "num_codebooks", "config.json")
    vocab = _int(hf, "vocab_size", "config.json")
    text_vocab = _int(hf, "text_vocab_size", "config.json")
    if n < 2:
        raise ValueError(f"config.json: field 'num_codebooks' must be >= 2, got {n}")
    for field, want in (
        ("num_codebooks", n),
        ("vocab_size", vocab),
        ("backbone_hidden_size", hf.get("hidden_size")),
    ):
        got = depth_hf.get(field)
        if got != want:
            raise ValueError(
                f"config.json: field 'depth_decoder_config.{field}' is {got!r}, the backbone's is {want!r}"
            )
    if _int(depth_hf, "max_position_embeddings", "depth_decoder_config") < n:
        raise ValueError(f"config.json: field 'depth_decoder_config.max_position_embeddings' must be >= {n}")
    rows = CsmRows(n, vocab, text_vocab)
    dt = dtype or hf.get("dtype") or hf.get("torch_dtype") or "float32"
    backbone = _part(hf, "config.json (backbone)", tandem_row_width=rows.width, dtype=dt, name="csm-backbone")
    backbone = dataclasses.replace(backbone, text_vocab_size=text_vocab)
    depth = _part(depth_hf, "config.json (depth_decoder_config)", dtype=dt, name="csm-depth")
    codec = hf.get("codec_config") or {}
    if not isinstance(codec, dict):
        raise ValueError("config.json: field 'codec_config' must be an object (Mimi's config)")
    if codec:
        if int(codec.get("num_quantizers", n)) < n:
            raise ValueError(f"config.json: field 'codec_config.num_quantizers' is below num_codebooks {n}")
        if int(codec.get("codebook_size", 0)) > vocab:
            raise ValueError(f"config.json: field 'codec_config.codebook_size' exceeds vocab_size {vocab}")
    special = {}
    for field in ("codebook_eos_token_id", "codebook_pad_token_id"):
        special[field] = _int(hf, field, "config.json")
        if not 0 <= special[field] < vocab:
            raise ValueError(f"config.json: field {field!r} must lie in [0, {vocab})")
    return CsmShape(
        backbone=backbone,
        depth=depth,
        rows=rows,
        tied_tables=bool(hf.get("tie_codebooks_embeddings", True)),
        codebook_eos=special["codebook_eos_token_id"],
        codebook_pad=special["codebook_pad_token_id"],
        audio_token=_int(hf, "audio_token_id", "config.json"),
        audio_eos_token=_int(hf, "audio_eos_token_id", "config.json"),
        codec=dict(codec),
    )


def check_codec(shape: CsmShape, mimi: dict[str, Any], where: str) -> None:
    """Raises ValueError naming the field when the Mimi whose config.json is `mimi` (read from
    `where`) cannot decode this CSM's frames: fewer quantizers than its codebooks, codes past its
    vocabulary, or another codec than the one its `codec_config` names (sampling rate, codebook
    size, quantizers)."""
    n, vocab = shape.rows.codebooks, shape.rows.codebook_vocab
    if int(mimi.get("num_quantizers", 0)) < n:
        raise ValueError(
            f"{where}: field 'num_quantizers' is {mimi.get('num_quantizers')!r}, below the {n} codebooks"
        )
    if int(mimi.get("codebook_size", vocab + 1)) > vocab:
        raise ValueError(
            f"{where}: field 'codebook_size' is {mimi.get('codebook_size')!r}, past vocab_size {vocab}"
        )
    for field in ("sampling_rate", "codebook_size", "num_quantizers"):
        if shape.codec and field in shape.codec and shape.codec[field] != mimi.get(field):
            raise ValueError(
                f"{where}: field {field!r} is {mimi.get(field)!r}; the checkpoint's codec_config.{field} "
                f"is {shape.codec[field]!r}"
            )


def is_csm(path: str | os.PathLike[str]) -> bool:
    """True when `path`'s config.json names model_type `csm` (read only; no check of the rest)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type") == MODEL_TYPE
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class CsmModel:
    """A loaded CSM: its checked shape and the two decoders (the caller owns them)."""

    shape: CsmShape
    backbone: CsmBackbone
    depth: CsmDepth


def load_csm(
    path: str | os.PathLike[str], device: torch.device | str = "cpu", dtype: str | None = None
) -> CsmModel:
    """Build both decoders from a CSM checkpoint directory, tensor by tensor (peak memory: the model
    plus one tensor). `dtype` overrides the checkpoint's. Missing, unexpected or misshapen tensors
    raise ValueError naming them; Mimi's `codec_model.*` tensors are skipped (the codec's)."""
    root = Path(path)
    if dtype is not None:
        torch_dtype(dtype)
    shape = csm_shape(json.loads((root / "config.json").read_text()), dtype)
    backbone = CsmBackbone(shape.backbone, shape.rows, device)
    depth = CsmDepth(shape.depth, shape.rows, shape.backbone.hidden_size, device)
    params = {"backbone": dict(backbone.named_parameters()), "depth": dict(depth.named_parameters())}
    seen: set[tuple[str, str]] = set()
    for file in shard_files(root):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith(_CODEC_PREFIX) or name.endswith(_IGNORED_SUFFIXES):
                    continue
                targets = _targets(name, shape.tied_tables)
                if not targets:
                    raise ValueError(f"unexpected tensor {name!r} in {file.name} (not a CSM weight)")
                tensor = f.get_tensor(name)
                for part, own in targets:
                    target = params[part][own]
                    got, want = tuple(tensor.shape), tuple(target.shape)
                    if got != want:
                        raise ValueError(f"{name}: checkpoint shape {got} != expected {want}")
                    with torch.no_grad():
                        target.copy_(tensor.to(target.dtype))
                    seen.add((part, own))
    missing = sorted(f"{part}:{own}" for part in params for own in params[part] if (part, own) not in seen)
    if missing:
        raise ValueError(
            f"checkpoint {root} lacks tensors: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    if shape.tied_tables:  # one tensor for both (CSM-1B's is 131 M parameters)
        depth.model.embed_tokens.table.weight = backbone.model.embed_tokens.audio.weight
    return CsmModel(shape, backbone, depth)


def _targets(name: str, tied: bool) -> list[tuple[str, str]]:
    """The (part, parameter) pairs a checkpoint tensor fills: two for a tied codebook table."""
    if tied and name in _TABLES:
        return [_rename(t) for t in _TABLES]
    renamed = _rename(name)
    return [renamed] if renamed[0] else []


def _rename(name: str) -> tuple[str, str]:
    for prefix, part, own in _RENAMES:
        if name.startswith(prefix):
            return part, own + name[len(prefix) :]
    return "", ""
