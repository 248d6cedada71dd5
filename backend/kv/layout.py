"""The shape of one token's KV across all layers: what a pool stores per slot and a transfer moves."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's KV across all layers; equal layouts can exchange KV byte for byte.

    `scale_digest` names the per-head scales of an E4M3 layout ("" for every other dtype): equal bytes
    mean equal values only under equal scales (backend/model/fp8.py)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    scale_digest: str = ""

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V for one token over all layers (what the transfer path moves per token)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize

    def staging_shape(self, n_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape `(L, 2, T, kvh, hd)` of a contiguous buffer holding `n_tokens` tokens' KV.

        Used by whoever allocates staging buffers for `KVPool.gather`/`KVPool.scatter`.
        """
        return (self.num_layers, 2, n_tokens, self.num_kv_heads, self.head_dim)
