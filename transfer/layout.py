"""The KV cache's shape on the wire, independent of any engine's paging.

P gathers a request's rows into one contiguous tensor of `staging_shape(n_tokens)`; exactly that many
bytes cross into D's receive region, and D scatters them into its own pages. The engine converts its
own KV layout into a `WireLayout`; both sides compare `fingerprint()` before any byte moves.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


@dataclass(frozen=True)
class WireLayout:
    """Per-token KV geometry: `num_layers` x (K, V) x `num_kv_heads` x `head_dim` of `dtype_name`.

    `scale_digest` names the static per-head scales an E4M3 KV's bytes are read at (each engine derives
    them from its weights; they never cross). "" for a KV without scales, and then it is left out of
    `to_dict` and the fingerprint, which stay what they were before it existed. P and D whose dtype or
    scales differ refuse each other before any byte moves (`LayoutMismatch`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_name: str
    scale_digest: str = ""

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"WireLayout.{field} must be a positive int, got {value!r}")
        if self.dtype_name not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype_name!r}; expected one of {sorted(_DTYPES)}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype_name]

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def staging_shape(self, n_tokens: int) -> tuple[int, int, int, int, int]:
        """(num_layers, 2, n_tokens, num_kv_heads, head_dim): the contiguous tensor `gather` fills."""
        if n_tokens <= 0:
            raise ValueError(f"n_tokens must be positive, got {n_tokens}")
        return (self.num_layers, 2, n_tokens, self.num_kv_heads, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes one token's KV occupies across all layers, K and V."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_bytes

    def staging_nbytes(self, n_tokens: int) -> int:
        return n_tokens * self.token_bytes

    def to_dict(self) -> dict[str, int | str]:
        d: dict[str, int | str] = asdict(self)
        if not self.scale_digest:
            del d["scale_digest"]
        return d

    def describe(self) -> str:
        """One phrase for an error: `28 layers x 8 KV heads x 128 float8_e4m3fn (scales ab12...)`."""
        scales = f" (scales {self.scale_digest})" if self.scale_digest else ""
        heads = f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim}"
        return f"{heads} {self.dtype_name}{scales}"

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> WireLayout:
        try:
            return cls(
                num_layers=int(d["num_layers"]),  # type: ignore[call-overload]
                num_kv_heads=int(d["num_kv_heads"]),  # type: ignore[call-overload]
                head_dim=int(d["head_dim"]),  # type: ignore[call-overload]
                dtype_name=str(d["dtype_name"]),
                scale_digest=str(d.get("scale_digest", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad layout {d!r}: {exc}") from exc

    def fingerprint(self) -> str:
        """16 hex digits identifying this layout; equal fingerprints mean byte-compatible staging."""
        canon = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]
