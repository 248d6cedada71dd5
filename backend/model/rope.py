"""RoPE inverse frequencies: unscaled, or with Llama 3's frequency-band scaling (`rope_type: llama3`,
which every Llama 3.x checkpoint ships; ignoring it gives subtly wrong logits).

`parse_rope` reads both config spellings (transformers < 5 `rope_scaling`, >= 5 `rope_parameters`)
into `RopeScaling` and refuses every other scaling by name; the decoder asks `inv_freq` once.
The maths is Llama 3.1's reference as transformers implements it, in float32 (logits match at 1e-4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

LLAMA3 = "llama3"
_UNSCALED = ("default", None)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE scaling (`rope_type: llama3`); the only scaling the decoder implements."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = LLAMA3

    def __post_init__(self) -> None:
        if self.rope_type != LLAMA3:
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; only {LLAMA3!r}")
        if not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                "rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError("rope scaling original_max_position_embeddings must be positive")

    def to_hf(self) -> dict[str, Any]:
        """The `rope_scaling` block transformers < 5 writes (and transformers >= 5 still reads)."""
        return {
            "rope_type": self.rope_type,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


def _llama3(block: Mapping[str, Any], field: str) -> RopeScaling:
    try:
        return RopeScaling(
            factor=float(block["factor"]),
            low_freq_factor=float(block["low_freq_factor"]),
            high_freq_factor=float(block["high_freq_factor"]),
            original_max_position_embeddings=int(block["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ValueError(f"{field} of type {LLAMA3!r} lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed {field} of type {LLAMA3!r}: {exc}") from None


def parse_rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None) from an HF `config.json` dict.

    Called by `checkpoint.config_from_hf`. Reads `rope_theta` + `rope_scaling` (transformers < 5) and
    `rope_parameters` {rope_type, rope_theta, ...} (transformers >= 5); when both name a scaling they
    must agree. Raises ValueError naming the field for any scaling other than unscaled and llama3.
    """
    found: list[RopeScaling | None] = []
    for field in ("rope_parameters", "rope_scaling"):
        block = hf.get(field)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise ValueError(f"unsupported {field}: {block!r}")
        kind = block.get("rope_type", block.get("type", "default"))
        if kind in _UNSCALED:
            found.append(None)
        elif kind == LLAMA3:
            found.append(_llama3(block, field))
        else:
            raise ValueError(
                f"unsupported {field} type {kind!r}: only unscaled ('default') and {LLAMA3!r} RoPE "
                "are implemented"
            )
    scalings = {s for s in found if s is not None}
    if len(scalings) > 1:
        raise ValueError("rope_scaling and rope_parameters name different scalings")
    theta = hf.get("rope_theta")
    params = hf.get("rope_parameters")
    if theta is None and isinstance(params, Mapping):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0), next(iter(scalings), None)


def inv_freq(
    head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device | str
) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies on `device` for RoPE with base `theta`, scaled by
    `scaling` when given. Called once by `Decoder.__init__`; the caller owns the tensor."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    base = 1.0 / (theta**exps)
    if scaling is None:
        return base
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor  # longer than this: divided by factor
    high_wavelen = old / scaling.high_freq_factor  # shorter than this: unchanged
    wavelen = 2 * math.pi / base
    slow = base / scaling.factor
    blend = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    medium = (1 - blend) * slow + blend * base
    out = torch.where(wavelen > low_wavelen, slow, base)
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, medium, out)
