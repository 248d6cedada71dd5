"""The decoder's linear layers: `linear(x, weight, bias)`, with the small-batch CUDA GEMV (csrc/gemv.cu).

Why: at small batch a decode step's projections only stream their weights, and cuBLAS's kernels for
these shapes read them at ~68 % of HBM on an H200 (issue 14). Up to `GEMV_MAX_ROWS` rows of x go
through `tandem.csrc._cuda_kernels.gemv` when it can run them (CUDA, the module built, float16/bfloat16,
contiguous 16-byte-aligned tensors of one dtype and device, K a multiple of 8, no gradient to track);
everything else, the CPU included, is `torch.nn.functional.linear`, which is also what the tests hold
the kernel to (float32 accumulation in both; the order of the additions differs, so results agree to
the dtype's rounding).

$TANDEM_BLAS picks the library torch's GEMMs go through for the whole process: unset or `default`
leaves torch's choice (cuBLAS), `cublas` or `cublaslt` call
`torch.backends.cuda.preferred_blas_library` at import. Why: at batch 64 the 4B step's GEMMs read 8.0
GB in 2.64 ms (63 % of HBM) through cuBLAS; cuBLASLt's heuristics pick other kernels, and
`tandem-bench-linear` times both per shape. Opt-in until measured.

$TANDEM_GEMV_ROWS sets `GEMV_MAX_ROWS` for a process. The default is 0 (every call to cuBLAS): the
kernel passes its CPU-side checks and compiles for sm_90, but no GPU has run it yet (no device was
lent the session that wrote it); `tandem-bench-linear` and the GPU tests in tests/unit/test_linear.py
are the measurement that decides the default.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tandem.csrc import kv_cuda

__all__ = ["BLAS", "GEMV_MAX_ROWS", "gemv_runs", "linear"]

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2}
_KERNEL_ROWS = 8  # csrc/gemv.h's kGemvMaxRows


def _max_rows() -> int:
    text = os.environ.get("TANDEM_GEMV_ROWS", "0").strip()
    try:
        rows = int(text)
    except ValueError:
        raise ValueError(f"TANDEM_GEMV_ROWS must be an integer 0..{_KERNEL_ROWS}, got {text!r}") from None
    if not 0 <= rows <= _KERNEL_ROWS:
        raise ValueError(f"TANDEM_GEMV_ROWS must be 0..{_KERNEL_ROWS}, got {rows}")
    return rows


GEMV_MAX_ROWS = _max_rows()

BLAS = os.environ.get("TANDEM_BLAS", "default").strip() or "default"
if BLAS not in ("default", "cublas", "cublaslt"):
    raise ValueError(f"TANDEM_BLAS must be default, cublas or cublaslt, got {BLAS!r}")
if BLAS != "default":
    if torch.version.cuda is None:
        raise ValueError(f"TANDEM_BLAS={BLAS} needs a CUDA build of torch; this one is {torch.__version__}")
    torch.backends.cuda.preferred_blas_library(BLAS)


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
    module = kv_cuda.module()
    assert module is not None
    n, k = weight.shape
    out = torch.empty((flat.shape[0], n), dtype=x.dtype, device=x.device)
    module.gemv(
        flat.data_ptr(),
        weight.data_ptr(),
        0 if bias is None else bias.data_ptr(),
        out.data_ptr(),
        flat.shape[0],
        n,
        k,
        _DTYPE_CODES[x.dtype],
        x.device.index or 0,
        int(torch.cuda.current_stream(x.device).cuda_stream),
    )
    return out.view(*x.shape[:-1], n)
