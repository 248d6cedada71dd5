"""The decoder's linear layers: `linear(x, weight, bias)`, with the small-batch CUDA GEMV (csrc/gemv.cu).

Why: at small batch a decode step's projections only stream their weights, and cuBLAS's kernels for
these shapes read them at ~68 % of HBM on an H200 (tandem-bench-decoder's
kernel-family breakdown, docs/benchmarks). Up to `GEMV_MAX_ROWS` rows of x go
through `tandem.csrc._cuda_kernels.gemv` when it can run them (CUDA, the module built, float16/bfloat16,
contiguous 16-byte-aligned tensors of one dtype and device, K a multiple of 8, no gradient to track);
everything else, the CPU included, is `torch.nn.functional.linear`, which is also what the tests hold
the kernel to (float32 accumulation in both; the order of the additions differs, so results agree to
the dtype's rounding).

A process-wide cuBLASLt switch (TANDEM_BLAS) was measured on an H200 and deleted: the graphed step at
1 and 64 x 2048 was within 1 % of cuBLAS for the 4B shape and 5 % slower at Orpheus-3B batch 1
(docs/benchmarks); `tandem-bench-linear` still times cuBLASLt per shape.

$TANDEM_GEMV_ROWS sets `GEMV_MAX_ROWS` for a process (0 sends every call to cuBLAS). The default is
8: on an H200 (docs/benchmarks) the GEMV took the Orpheus-3B shape's graphed step at batch 1
from 2.71 to 2.55 ms and left the 4B shape's at 3.36 ms, and tests/unit/test_linear.py passed there.

`gemv_fp8` is the same kernel over E4M3 weights with per-row scales (tandem.model.dtype=fp8 at up to
`GEMV_MAX_ROWS` rows: half the weight bytes, x stays bfloat16).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tandem.csrc import kv_cuda

__all__ = ["GEMV_MAX_ROWS", "gemv_fp8", "gemv_fp8_runs", "gemv_runs", "linear"]

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2}
_KERNEL_ROWS = 8  # csrc/gemv.h's kGemvMaxRows


def _max_rows() -> int:
    text = os.environ.get("TANDEM_GEMV_ROWS", "8").strip()
    try:
        rows = int(text)
    except ValueError:
        raise ValueError(f"TANDEM_GEMV_ROWS must be an integer 0..{_KERNEL_ROWS}, got {text!r}") from None
    if not 0 <= rows <= _KERNEL_ROWS:
        raise ValueError(f"TANDEM_GEMV_ROWS must be 0..{_KERNEL_ROWS}, got {rows}")
    return rows


GEMV_MAX_ROWS = _max_rows()


def gemv_runs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int | None = None
) -> bool:
    """True when `linear(x, weight, bias)` runs the GEMV kernel (see the module's docstring)."""
    module = kv_cuda.module()
    limit = min(GEMV_MAX_ROWS if max_rows is None else max_rows, _KERNEL_ROWS)
    if module is None or not hasattr(module, "gemv") or x.device.type != "cuda":
        return False
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] == 0:
        return False
    rows, k = x.shape
    if not 1 <= rows <= limit or weight.shape[1] != k or k % 8 or x.dtype not in _DTYPE_CODES:
        return False
    tensors = [x, weight] if bias is None else [x, weight, bias]
    if bias is not None and bias.shape != (weight.shape[0],):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # the kernel has no backward: autograd keeps F.linear
    return all(
        t.dtype == x.dtype and t.device == x.device and t.is_contiguous() and t.data_ptr() % 16 == 0
        for t in tensors
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, max_rows: int | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (x [..., K], weight [N, K], bias [N] or None -> [..., N]); x of at most
    `max_rows` (default `GEMV_MAX_ROWS`) rows runs the GEMV kernel when `gemv_runs` says it can."""
    limit = GEMV_MAX_ROWS if max_rows is None else max_rows
    if limit <= 0:
        return F.linear(x, weight, bias)  # switched off: no checks on the (ungraphed) prefill's path
    flat = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if not gemv_runs(flat, weight, bias, limit):
        return F.linear(x, weight, bias)
    return _gemv(flat, weight, bias, None).view(*x.shape[:-1], weight.shape[0])


def _gemv(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, w_scale: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's y [M, N] in x's dtype for x [M, K] and w [N, K] (E4M3 with `w_scale`)."""
    module = kv_cuda.module()
    assert module is not None
    n, k = w.shape
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    module.gemv(
        x.data_ptr(),
        w.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        x.shape[0],
        n,
        k,
        _DTYPE_CODES[x.dtype],
        x.device.index or 0,
        int(torch.cuda.current_stream(x.device).cuda_stream),
        **({} if w_scale is None else {"w_scale": w_scale.data_ptr()}),  # a module built before it takes none
    )
    return out


def gemv_fp8_runs(x: torch.Tensor, w8: torch.Tensor) -> bool:
    """True when `gemv_fp8(x, w8, ...)` has a kernel: the module built with it, CUDA, bfloat16 x of at
    most `GEMV_MAX_ROWS` rows, E4M3 w8 [N, K] with K a multiple of 16, contiguous, 16-byte aligned."""
    module = kv_cuda.module()
    if module is None or not hasattr(module, "gemv_fp8") or not x.is_cuda or x.dtype != torch.bfloat16:
        return False
    if x.dim() != 2 or w8.dim() != 2 or w8.dtype != torch.float8_e4m3fn or w8.shape[1] != x.shape[1]:
        return False
    if not 1 <= x.shape[0] <= min(GEMV_MAX_ROWS, _KERNEL_ROWS) or w8.shape[1] % 16:
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.device == x.device for t in (x, w8))


def gemv_fp8(
    x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y [M, N] bfloat16 = (x . w8^T) * scale + bias for bfloat16 x [M, K], E4M3 w8 [N, K], float32
    scale (N values, contiguous) and a bfloat16 bias [N] or None; `gemv_fp8_runs` must hold."""
    return _gemv(x, w8, bias, scale)
