"""E4M3 (float8_e4m3fn) pieces the kernels and their torch references share: per-row quantisation of
activations, and the KV cache's quantise / write / read at per-(K or V, KV head) scales.

Why here, below the model: the Triton kernels (`triton_ops`), the paged attention's reference
(`kv_cuda.reference_decode_attention`) and the model's attention dispatch must compute the same
function bit for bit, so the definition lives once, beside the kernels. The rules:

- Activations, per row: amax = max |x| (at least 1e-12), inv = 448 / amax and scale = amax / 448 (each
  an IEEE float32 division), x8 = round-to-nearest-even(x * inv) clamped to +-448, x ~= x8 * scale.
- KV, per layer, K or V, and KV head: a power-of-two scale s (backend/model/fp8.py derives it from the
  weights); x8 = rn(x * (1/s)), x = x8 * s, both exact multiplications, so the Triton write, the
  CUDA read and these references agree exactly.

torch on the CPU has no index_copy_ for float8 (it has index_select), so writes go through uint8
views of the same bytes.
"""

from __future__ import annotations

import torch

__all__ = [
    "E4M3",
    "E4M3_MAX",
    "dequantize_kv",
    "is_fp8",
    "quantize_kv",
    "read_kv",
    "reference_quantize_rows",
    "write_kv",
]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
TINY = 1e-12  # the smallest amax a row's scale is taken from (an all-zero row keeps finite scales)


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    return (t if isinstance(t, torch.dtype) else t.dtype) == E4M3


def reference_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 [M, K] E4M3, scale [M, 1] float32), x ~= x8 * scale (the module's rule)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=TINY)
    x8 = (xf * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, amax / E4M3_MAX


def quantize_kv(kv: torch.Tensor, inv_scales: torch.Tensor) -> torch.Tensor:
    """K/V values [2, N, kvh, hd] -> E4M3 at one layer's inverse scales [2, kvh] (powers of two)."""
    inv = inv_scales.float()[:, None, :, None]
    return (kv.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize_kv(kv8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """E4M3 K/V [2, N, kvh, hd] at scales [2, kvh] -> `dtype` (exact for bf16, fp16 and fp32)."""
    return (kv8.float() * scales.float()[:, None, :, None]).to(dtype)


def write_kv(
    kv: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, inv_scales: torch.Tensor | None
) -> None:
    """Write K/V rows `new` [2, N, kvh, hd] into one layer of a pool `kv` [2, S, kvh, hd] at `slots`
    [N]: as they are for a pool in their dtype, quantised at `inv_scales` [2, kvh] for an E4M3 pool."""
    if not is_fp8(kv):
        kv.index_copy_(1, slots, new.to(kv.dtype))
        return
    if inv_scales is None:
        raise ValueError("an E4M3 KV pool needs its inverse scales to be written")
    kv.view(torch.uint8).index_copy_(1, slots, quantize_kv(new, inv_scales).view(torch.uint8))


def read_kv(
    kv: torch.Tensor, slots: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """K/V of one layer of a pool `kv` [2, S, kvh, hd] at `slots` [N] -> [2, N, kvh, hd] in `dtype`
    (dequantised at `scales` [2, kvh] for an E4M3 pool)."""
    rows = kv.index_select(1, slots)
    if not is_fp8(kv):
        return rows if rows.dtype == dtype else rows.to(dtype)
    if scales is None:
        raise ValueError("an E4M3 KV pool needs its scales to be read")
    return dequantize_kv(rows, scales, dtype)
