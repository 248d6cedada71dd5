"""Fused elementwise kernels of the decoder's GPU step (Triton), each with its torch reference.

Why: an eager decode step spent about half its kernel time in ~45 tiny elementwise kernels per layer
(RMSNorm alone is seven: cast, square, mean, add, rsqrt, multiply, cast; RoPE and qk-norm a dozen more;
the K/V write two), each a launch and a round trip through memory of a few kilobytes. Three kernels
replace them (docs/benchmarks, decoder-*-fused):

- `add_rms_norm(a, residual, weight, eps)`: residual + a (the residual stream's add) and RMSNorm of the
  sum, one pass; returns (normed, new residual). `residual=None` is the plain norm.
- `rope_kv_write(qkv, cos, sin, q_norm, k_norm, eps, kv, slots)`: from the fused QKV projection's
  output, per head: Qwen3's q/k RMSNorm (when the weights are given), RoPE, then K and V written into
  one layer of the paged pool at `slots`; returns q [N, nh, hd].
- `swiglu(gate_up)`: silu(gate) * up from the fused gate-up projection's output.

For `tandem.model.dtype=fp8` (backend/model/fp8.py) the GEMM inputs are E4M3 rows with a scale each:
`add_rms_norm_fp8` and `swiglu_fp8` quantise the row they produce in the same kernel, and
`quantize_rows` does it for attention's output (the rule is `csrc/fp8.py`'s). With an E4M3 KV pool
(`tandem.kv.dtype=fp8`) `rope_kv_write` stores K and V quantised at the layer's per-head scales.

Numerics follow the torch modules (`backend/model/layers.py`) step for step, each intermediate rounded to the
model dtype where torch rounds it (the norm in float32, then cast, then times the weight; RoPE as
x*cos + rotate_half(x)*sin with each product rounded), so results differ from the torch path only in
the order of the norm's float32 sum. The `reference_*` functions are the torch definitions the GPU
tests hold the kernels to, and what runs where Triton does not (`available`): CPU tensors, no Triton.

Every kernel runs on the current stream, reads no host value after launch and has static shapes given
static inputs: CUDA-graph safe once compiled (the first call of a shape compiles; graph warm-up does).
Inputs must be contiguous; wrappers raise ValueError on shapes that do not fit together.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch

from tandem.csrc.fp8 import E4M3_MAX, TINY, is_fp8, reference_quantize_rows, write_kv

__all__ = [
    "add_rms_norm",
    "add_rms_norm_fp8",
    "available",
    "quantize_rows",
    "reference_add_rms_norm",
    "reference_add_rms_norm_fp8",
    "reference_rope_kv_write",
    "reference_swiglu",
    "reference_swiglu_fp8",
    "rope_kv_write",
    "swiglu",
    "swiglu_fp8",
]

_triton: ModuleType | None
_tl: Any
try:
    _triton = importlib.import_module("triton")
    _tl = importlib.import_module("triton.language")
except ImportError:  # CPU installs: the references run instead
    _triton = None
    _tl = None


def available(t: torch.Tensor) -> bool:
    """True when the Triton kernels run for tensors like `t` (CUDA tensor, Triton importable)."""
    return _triton is not None and t.is_cuda


# ---- torch references (also the fallback) ---------------------------------------------------------------


def reference_add_rms_norm(
    a: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(residual + a), residual + a), as `layers.RMSNorm` after the residual add."""
    x = a if residual is None else residual + a
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def _reference_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def reference_rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kv: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    kv_inv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, nh, hd] with (q-norm and) RoPE applied; K (normed, rotated) and V written into `kv`
    [2, S, kvh, hd] at `slots` [N] (an E4M3 `kv` takes them times `kv_inv_scales` [2, kvh], the
    layer's inverse scales). `qkv` is [N, (nh + 2 kvh) * hd] in q, k, v order."""
    n = qkv.shape[0]
    kvh, hd = kv.shape[2], kv.shape[3]
    q, k, v = qkv.split([num_heads * hd, kvh * hd, kvh * hd], dim=-1)
    q, k, v = q.reshape(n, num_heads, hd), k.reshape(n, kvh, hd), v.reshape(n, kvh, hd)
    if q_norm is not None and k_norm is not None:
        q, k = _reference_rms(q, q_norm, eps), _reference_rms(k, k_norm, eps)
    q, k = _reference_rope(q, cos, sin), _reference_rope(k, cos, sin)
    write_kv(kv, slots, torch.stack((k, v)), kv_inv_scales)
    return q


def reference_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` [N, 2I] (gate's columns first)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference_add_rms_norm_fp8(
    a: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 rows of `reference_add_rms_norm`'s normed output, their scales [N, 1], the new residual)."""
    h, x = reference_add_rms_norm(a, residual, weight, eps)
    h8, scale = reference_quantize_rows(h)
    return h8, scale, x


def reference_swiglu_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 rows of `reference_swiglu` (rounded to gate_up's dtype first) and their scales [N, 1]."""
    return reference_quantize_rows(reference_swiglu(gate_up))


# ---- Triton kernels -------------------------------------------------------------------------------------

if _triton is not None:
    triton = _triton
    tl = _tl
    # Kernels may read module globals only as constexprs.
    F8_MAX = tl.constexpr(E4M3_MAX)
    F8_TINY = tl.constexpr(TINY)

    @triton.jit
    def _store_rows_fp8(out_ptr, scale_ptr, row, offs, mask, y):  # type: ignore[no-untyped-def]
        # csrc/fp8.py's rule: amax, inv = 448 / amax, scale = amax / 448 (IEEE divisions), rn(y * inv).
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), F8_TINY)
        lim = tl.zeros_like(amax) + F8_MAX
        q = tl.clamp(y * tl.math.div_rn(lim, amax), -F8_MAX, F8_MAX)
        tl.store(out_ptr + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(scale_ptr + row, tl.math.div_rn(amax, lim))

    @triton.jit
    def _store_e4m3(dst, x1, x2, inv, mask, HALF: tl.constexpr):  # type: ignore[no-untyped-def]
        # Both halves of a head's row as E4M3 at inverse scale `inv` (csrc/fp8.py's KV rule).
        q1 = tl.clamp(x1.to(tl.float32) * inv, -F8_MAX, F8_MAX)
        q2 = tl.clamp(x2.to(tl.float32) * inv, -F8_MAX, F8_MAX)
        tl.store(dst, q1.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(dst + HALF, q2.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]
        a_ptr,
        r_ptr,
        w_ptr,
        out_ptr,
        res_ptr,
        scale_ptr,
        n_cols,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
        FP8: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        dt = a_ptr.dtype.element_ty
        x = tl.load(a_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
            x = (r + x).to(dt).to(tl.float32)
            tl.store(res_ptr + row * n_cols + offs, x.to(dt), mask=mask)
        var = tl.sum(x * x, axis=0) / n_cols
        y = (x * tl.math.rsqrt(var + eps)).to(dt).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if FP8:
            _store_rows_fp8(out_ptr + row * n_cols, scale_ptr, row, offs, mask, (w * y).to(dt).to(tl.float32))
        else:
            tl.store(out_ptr + row * n_cols + offs, (w * y).to(dt), mask=mask)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, n_cols, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        y = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
        _store_rows_fp8(out_ptr + row * n_cols, scale_ptr, row, offs, mask, y)

    # n_rows (the batch) is not specialised: Triton would compile a variant for 1, for multiples of 16
    # and for other values, so decode steps at different batch sizes compiled their own kernels.
    @triton.jit(do_not_specialize=["n_rows"])
    def _rope_kv_write_kernel(  # type: ignore[no-untyped-def]
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        q_ptr,
        kv_ptr,
        slot_ptr,
        inv_ptr,
        plane,
        n_rows,
        eps,
        NH: tl.constexpr,
        KVH: tl.constexpr,
        HD: tl.constexpr,
        HAS_NORM: tl.constexpr,
        ROWS: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        # One head (program_id 1) of ROWS consecutive rows (program_id 0): a [ROWS, HD/2] tile per half.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        live = rows < n_rows
        j = tl.program_id(1)
        HALF: tl.constexpr = HD // 2
        offs = tl.arange(0, HALF)
        m = live[:, None]
        dt = q_ptr.dtype.element_ty
        src = qkv_ptr + rows[:, None] * ((NH + 2 * KVH) * HD) + j * HD + offs[None, :]
        slot = tl.load(slot_ptr + rows, mask=live, other=0)
        if j < NH + KVH:
            x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
            if HAS_NORM:
                ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
                rstd = tl.math.rsqrt(ss / HD + eps)[:, None]
                is_q = j < NH
                w1 = tl.where(is_q, tl.load(qw_ptr + offs), tl.load(kw_ptr + offs)).to(tl.float32)[None, :]
                w2 = tl.where(is_q, tl.load(qw_ptr + HALF + offs), tl.load(kw_ptr + HALF + offs))
                x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                x2 = (w2.to(tl.float32)[None, :] * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            cs = cos_ptr + rows[:, None] * HD + offs[None, :]
            sn = sin_ptr + rows[:, None] * HD + offs[None, :]
            c1 = tl.load(cs, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cs + HALF, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(sn, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(sn + HALF, mask=m, other=0.0).to(tl.float32)
            o1 = ((x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)).to(dt)
            o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
            if j < NH:
                qdst = q_ptr + rows[:, None] * (NH * HD) + j * HD + offs[None, :]
                tl.store(qdst, o1, mask=m)
                tl.store(qdst + HALF, o2, mask=m)
            else:
                dst = kv_ptr + slot[:, None] * (KVH * HD) + (j - NH) * HD + offs[None, :]
                if KV_FP8:  # csrc/fp8.py: rn(k * (1 / s)), the inverse a power of two
                    _store_e4m3(dst, o1, o2, tl.load(inv_ptr + (j - NH)), m, HALF)
                else:
                    tl.store(dst, o1, mask=m)
                    tl.store(dst + HALF, o2, mask=m)
        else:
            dst = kv_ptr + plane + slot[:, None] * (KVH * HD) + (j - NH - KVH) * HD + offs[None, :]
            v1 = tl.load(src, mask=m)
            v2 = tl.load(src + HALF, mask=m)
            if KV_FP8:  # V's inverse scales follow K's: index KVH + head
                _store_e4m3(dst, v1, v2, tl.load(inv_ptr + (j - NH)), m, HALF)
            else:
                tl.store(dst, v1, mask=m)
                tl.store(dst + HALF, v2, mask=m)

    @triton.jit
    def _swiglu_kernel(  # type: ignore[no-untyped-def]
        gu_ptr, out_ptr, scale_ptr, inter, BLOCK: tl.constexpr, FP8: tl.constexpr
    ):
        # FP8: one program a row (BLOCK covers it) so the row's amax is in the program.
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        dt = gu_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        if FP8:
            _store_rows_fp8(out_ptr + row * inter, scale_ptr, row, offs, mask, (s * u).to(dt).to(tl.float32))
        else:
            tl.store(out_ptr + row * inter + offs, (s * u).to(dt), mask=mask)


# ---- entry points ---------------------------------------------------------------------------------------


def _need_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def add_rms_norm(
    a: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new residual) for rows `a` [N, H] (plus `residual` [N, H] when given); new tensors."""
    if a.dim() != 2 or weight.shape != (a.shape[1],) or (residual is not None and residual.shape != a.shape):
        raise ValueError(f"add_rms_norm: a {tuple(a.shape)}, weight {tuple(weight.shape)} do not fit")
    if not available(a):
        return reference_add_rms_norm(a, residual, weight, eps)
    _need_contiguous(a=a, weight=weight, **({} if residual is None else {"residual": residual}))
    n, h = a.shape
    out = torch.empty_like(a)
    res = torch.empty_like(a) if residual is not None else a
    block = _triton.next_power_of_2(h)  # type: ignore[union-attr]
    _add_rms_norm_kernel[(n,)](
        a, a if residual is None else residual, weight, out, res, a, h, eps,
        HAS_RES=residual is not None, BLOCK=block, FP8=False, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return out, res


def add_rms_norm_fp8(
    a: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_rms_norm` whose normed output comes as E4M3 rows and their float32 scales [N, 1] (the
    input of an FP8 GEMM), with the new residual in a's dtype."""
    if a.dim() != 2 or weight.shape != (a.shape[1],) or (residual is not None and residual.shape != a.shape):
        raise ValueError(f"add_rms_norm_fp8: a {tuple(a.shape)}, weight {tuple(weight.shape)} do not fit")
    if not available(a):
        return reference_add_rms_norm_fp8(a, residual, weight, eps)
    _need_contiguous(a=a, weight=weight, **({} if residual is None else {"residual": residual}))
    n, h = a.shape
    out = torch.empty((n, h), dtype=torch.float8_e4m3fn, device=a.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=a.device)
    res = torch.empty_like(a) if residual is not None else a
    block = _triton.next_power_of_2(h)  # type: ignore[union-attr]
    _add_rms_norm_kernel[(n,)](
        a, a if residual is None else residual, weight, out, res, scale, h, eps,
        HAS_RES=residual is not None, BLOCK=block, FP8=True, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return out, scale, res


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 rows of `x` [N, K] and their float32 scales [N, 1] (`csrc/fp8.py`'s rule); one kernel."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be [N, K], got {tuple(x.shape)}")
    if not available(x):
        return reference_quantize_rows(x)
    _need_contiguous(x=x)
    n, k = x.shape
    out = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    block = _triton.next_power_of_2(k)  # type: ignore[union-attr]
    _quantize_rows_kernel[(n,)](x, out, scale, k, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out, scale


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kv: torch.Tensor,
    slots: torch.Tensor,
    num_heads: int,
    rows_per_program: int = 1,
    kv_inv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `reference_rope_kv_write` (q returned; K and V written into `kv` at `slots`,
    which the caller keeps inside the pool: they are not bounds-checked on the device; an E4M3 `kv`
    needs `kv_inv_scales` [2, kvh] float32, contiguous, on its device).

    `rows_per_program` (a power of two): rows one program takes per head. 1 suits a decode step (a few
    rows, one small program per row and head); a prefill passes 16: with one row a program moves 256
    bytes, and 2,048 rows of the 4B shape took 61 us a layer on an H200, ~5x their bytes' time. A
    caller keeps one value per kind of call, so a row's result never depends on the rows beside it."""
    n = qkv.shape[0]
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise ValueError(f"rope_kv_write: kv must be [2, S, kvh, hd], got {tuple(kv.shape)}")
    kvh, hd = kv.shape[2], kv.shape[3]
    if qkv.shape != (n, (num_heads + 2 * kvh) * hd) or cos.shape != (n, hd) or slots.shape != (n,):
        raise ValueError(
            f"rope_kv_write: qkv {tuple(qkv.shape)}, cos {tuple(cos.shape)}, slots {tuple(slots.shape)} "
            f"do not fit {num_heads} heads, kv {tuple(kv.shape)}"
        )
    fp8 = is_fp8(kv)
    if fp8 and (kv_inv_scales is None or kv_inv_scales.shape != (2, kvh)):
        raise ValueError(f"rope_kv_write: an E4M3 kv needs kv_inv_scales [2, {kvh}]")
    if not available(qkv) or hd % 2 or hd & (hd - 1):
        return reference_rope_kv_write(
            qkv, cos, sin, q_norm, k_norm, eps, kv, slots, num_heads, kv_inv_scales
        )
    _need_contiguous(qkv=qkv, cos=cos, sin=sin, kv=kv, slots=slots)
    inv = kv_inv_scales if fp8 and kv_inv_scales is not None else cos  # any pointer when unused
    if fp8:
        _need_contiguous(kv_inv_scales=inv)
    q = torch.empty((n, num_heads, hd), dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None and k_norm is not None
    qw = q_norm if q_norm is not None else cos
    kw = k_norm if k_norm is not None else cos
    r = rows_per_program
    if r < 1 or r & (r - 1):
        raise ValueError(f"rope_kv_write: rows_per_program must be a power of two, got {r}")
    _rope_kv_write_kernel[(-(-n // r), num_heads + 2 * kvh)](
        qkv, cos, sin, qw, kw, q, kv, slots, inv, kv.shape[1] * kvh * hd, n, eps,
        NH=num_heads, KVH=kvh, HD=hd, HAS_NORM=has_norm, ROWS=r, KV_FP8=fp8, num_warps=1 if r == 1 else 4,
    )  # fmt: skip
    return q


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for `gate_up` [N, 2I]; a new [N, I] tensor."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu: gate_up must be [N, 2I], got {tuple(gate_up.shape)}")
    if not available(gate_up):
        return reference_swiglu(gate_up)
    _need_contiguous(gate_up=gate_up)
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _swiglu_kernel[(n, -(-inter // block))](gate_up, out, out, inter, BLOCK=block, FP8=False, num_warps=4)
    return out


def swiglu_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`swiglu` as E4M3 rows and their float32 scales [N, 1] (the down projection's FP8 input)."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu_fp8: gate_up must be [N, 2I], got {tuple(gate_up.shape)}")
    if not available(gate_up):
        return reference_swiglu_fp8(gate_up)
    _need_contiguous(gate_up=gate_up)
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, inter), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=gate_up.device)
    block = _triton.next_power_of_2(inter)  # type: ignore[union-attr]
    _swiglu_kernel[(n, 1)](
        gate_up, out, scale, inter, BLOCK=block, FP8=True, num_warps=16 if block >= 8192 else 8
    )
    return out, scale
