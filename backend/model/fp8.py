"""FP8 (E4M3) weights and KV scales: quantisation at load, the scaled matmul, the CPU's reference maths.

`tandem.model.dtype=fp8` (docs/operations.md): every projection of every layer is stored as E4M3 with
one float32 scale per output channel (amax / 448), computed at load from the bf16/fp32 checkpoint.
The embedding table, output head and norms stay bf16 (the head's logits are what sampling reads).

The matmul is `torch._scaled_mm` with rowwise scales (sm_89+), activations quantised per row on the
fly (`triton_ops.quantize_rows`, or fused into the kernels that produce them), float32 accumulation.
The CPU cannot run it: `emulate=True` (tests only) computes the same function from the dequantised
operands in float32, the reference the GPU tests hold `_scaled_mm` to.

KV scales (`tandem.kv.dtype=fp8`, `kv_scales`): static, one per (layer, K or V, KV head), from the
weights alone, so P and D compute equal scales from equal checkpoints (their digest is part of the KV
layout). Each is an upper bound of |K| or |V| over every input, rounded up to a power of two: no value
saturates, and (de)quantising is an exact multiplication in every kernel and reference.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.csrc import linear, triton_ops
from tandem.csrc.fp8 import E4M3, E4M3_MAX, TINY

if TYPE_CHECKING:
    from tandem.backend.model.layers import DecoderLayer, RMSNorm

__all__ = [
    "Fp8Layer",
    "Fp8Unsupported",
    "Fp8Weight",
    "fp8_linear",
    "kv_digest",
    "kv_scales",
    "quantize_layer",
    "quantize_weight",
    "require_fp8_device",
    "run_layers",
]

# |values| through bf16 rounding may exceed the exact bound by 2^-8 relative; the KV bound takes 1 %.
_KV_MARGIN = 1.01


class Fp8Unsupported(RuntimeError):
    """FP8 was asked of a device that cannot run it (the CPU, or a GPU below compute capability 8.9)."""


def require_fp8_device(device: torch.device, what: str) -> None:
    """Raise `Fp8Unsupported` naming `what` (the setting) unless `device` runs E4M3 matmuls/kernels."""
    if device.type != "cuda":
        raise Fp8Unsupported(
            f"{what}=fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this engine "
            f"runs on {device}. The CPU runs bf16/fp32 only"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise Fp8Unsupported(
            f"{what}=fp8 needs compute capability 8.9 or newer; {device} ({name}) is {major}.{minor}"
        )


@dataclass(frozen=True)
class Fp8Weight:
    """One projection in E4M3: W ~= data * scale.T, per output channel; `bias` in the compute dtype."""

    data: torch.Tensor  # [N, K] float8_e4m3fn, row-major (its .t() is the column-major B of _scaled_mm)
    scale: torch.Tensor  # [1, N] float32 (the shape _scaled_mm's rowwise scale_b takes)
    bias: torch.Tensor | None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale.t()).to(dtype)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.data.numel() + self.scale.numel() * 4 + extra


def quantize_weight(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Fp8Weight:
    """Per-output-channel E4M3 of `weight` [N, K]: scale_n = amax(|W[n]|) / 448, W8 = W / scale
    (so every row's largest element maps to +-448; the round trip errs by at most half an E4M3 step,
    |W - W8 * s| <= max(|W| / 16, s * 2^-10))."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight needs a [N, K] weight, got {tuple(weight.shape)}")
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=TINY) / E4M3_MAX
    data = (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous()
    return Fp8Weight(data, scale[None, :].contiguous(), None if bias is None else bias.detach().clone())


def fp8_linear(
    x8: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, out_dtype: torch.dtype, emulate: bool = False
) -> torch.Tensor:
    """(x8 * x_scale) . (w.data * w.scale)^T + bias -> [M, N] in `out_dtype`, float32 accumulation.

    On CUDA `torch._scaled_mm` (rowwise scales; K and N multiples of 16, out bf16). `emulate` (or a CPU
    tensor) computes the same from the dequantised operands with F.linear in float32: the reference."""
    if emulate or not x8.is_cuda:
        b = None if w.bias is None else w.bias.float()
        return F.linear(x8.float() * x_scale, w.dequantize(), b).to(out_dtype)
    return torch._scaled_mm(
        x8,
        w.data.t(),
        scale_a=x_scale,
        scale_b=w.scale,
        bias=w.bias,
        out_dtype=out_dtype,
        use_fast_accum=False,
    )


@dataclass(frozen=True)
class Fp8Layer:
    """One decoder layer's projections in E4M3 (q/k/v and gate/up fused, as the bf16 step runs them)."""

    qkv: Fp8Weight
    o: Fp8Weight
    gate_up: Fp8Weight
    down: Fp8Weight

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (self.qkv, self.o, self.gate_up, self.down))


def quantize_layer(layer: DecoderLayer) -> Fp8Layer:
    """The layer's four projections quantised from its current (bf16/fp32) weights."""
    attn, mlp = layer.self_attn, layer.mlp
    w, b = attn.qkv_weight()
    return Fp8Layer(
        qkv=quantize_weight(w, b),
        o=quantize_weight(attn.o_proj.weight, attn.o_proj.bias),
        gate_up=quantize_weight(mlp.gate_up_weight()),
        down=quantize_weight(mlp.down_proj.weight, mlp.down_proj.bias),
    )


# ---- the FP8 step ------------------------------------------------------------------------------------

# attend(layer, qkv [N, (nh + 2 kvh) * hd], cos, sin) -> [N, nh * hd] (backend/model/attention.py)
AttendQKV = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# A GEMM input: E4M3 rows and their scales (W8A8), or rows in the compute dtype and None (weight-only).
Act = tuple[torch.Tensor, torch.Tensor | None]


def weight_only(rows: int, x: torch.Tensor, w: Fp8Weight, emulate: bool) -> bool:
    """True when a forward of `rows` rows runs weight-only FP8 (x stays bf16; `linear.gemv_fp8`): at
    most `linear.GEMV_MAX_ROWS` rows (a decode step of a few streams, where a step only streams its
    weights and the GEMV reads them at HBM speed), where the kernel exists (or emulated)."""
    if rows > linear.GEMV_MAX_ROWS:
        return False
    return emulate or not x.is_cuda or linear.gemv_fp8_runs(x[:rows], w.data)


def project(act: Act, w: Fp8Weight, out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """One projection of a GEMM input (`Act`): W8A8 through `fp8_linear`, or weight-only."""
    x, scale = act
    if scale is not None:
        return fp8_linear(x, scale, w, out_dtype, emulate)
    if emulate or not x.is_cuda:
        b = None if w.bias is None else w.bias.float()
        return F.linear(x.float(), w.dequantize(), b).to(out_dtype)
    return linear.gemv_fp8(x, w.data, w.scale, w.bias)


def run_layers(
    layers: Sequence[DecoderLayer],
    quantized: Sequence[Fp8Layer],
    final_norm: RMSNorm,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attend: AttendQKV,
    emulate: bool,
) -> torch.Tensor:
    """The fused step (`Decoder._run_fused`) with E4M3 projections. W8A8 (more than
    `linear.GEMV_MAX_ROWS` rows): each norm and SwiGLU hands its output to the next GEMM as E4M3 rows
    with their scales (one kernel), attention's output is quantised by `triton_ops.quantize_rows`.
    Weight-only (fewer rows, `weight_only`): the same kernels in bf16 and the E4M3 GEMV. The residual
    stream, attention and the final norm stay in x's dtype. Returns the final-normed hidden states."""
    dt = x.dtype
    w8a16 = weight_only(x.shape[0], x, quantized[0].qkv, emulate)

    def norm(
        a: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[Act, torch.Tensor]:
        if w8a16:
            h, r = triton_ops.add_rms_norm(a, res, weight, eps)
            return (h, None), r
        h8, hs, r = triton_ops.add_rms_norm_fp8(a, res, weight, eps)
        return (h8, hs), r

    def rows(t: torch.Tensor) -> Act:
        return (t, None) if w8a16 else triton_ops.quantize_rows(t)

    def swiglu(gate_up: torch.Tensor) -> Act:
        return (triton_ops.swiglu(gate_up), None) if w8a16 else triton_ops.swiglu_fp8(gate_up)

    h, x = norm(x, None, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
    for i, (layer, q) in enumerate(zip(layers, quantized, strict=True)):
        o = attend(i, project(h, q.qkv, dt, emulate), cos, sin)
        post = layer.post_attention_layernorm
        h, x = norm(project(rows(o), q.o, dt, emulate), x, post.weight, post.eps)
        down = project(swiglu(project(h, q.gate_up, dt, emulate)), q.down, dt, emulate)
        if i + 1 < len(layers):
            nxt = layers[i + 1].input_layernorm
            h, x = norm(down, x, nxt.weight, nxt.eps)
        else:
            out, _ = triton_ops.add_rms_norm(down, x, final_norm.weight, final_norm.eps)
            return out
    raise ValueError("run_layers needs at least one layer")


# ---- KV scales -----------------------------------------------------------------------------------------


def _pow2_at_least(bound: torch.Tensor) -> torch.Tensor:
    """The least power of two s with s * 448 >= bound (elementwise, float32)."""
    return torch.exp2(torch.ceil(torch.log2(bound.clamp(min=TINY) / E4M3_MAX)))


def _rope_pairs(bound: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Bounds [.., hd] after RoPE: elements i and i + hd/2 rotate together, so each is bounded by the
    pair's Euclidean norm."""
    half = head_dim // 2
    pair = torch.sqrt(bound[..., :half] ** 2 + bound[..., half:] ** 2)
    return torch.cat((pair, pair), dim=-1)


@torch.no_grad()
def kv_scales(
    layers: Sequence[DecoderLayer], hidden: int, head_dim: int, kv_heads: int, qk_norm: bool
) -> torch.Tensor:
    """Per-(layer, K/V, KV head) E4M3 scales [L, 2, kvh] float32, powers of two, from the weights.

    The input of k_proj/v_proj is RMSNorm(x) = g * x_hat with ||x_hat||_2 <= sqrt(H) whatever x is, so
    |k_j| <= ||W_k[j] * g||_2 sqrt(H) + |b_j| (Cauchy-Schwarz), likewise v. With Qwen3's k-norm each
    head of K is RMS-normed again: |k_i| <= sqrt(hd) |g_k,i|. RoPE rotates the pairs (i, i + hd/2), so
    a K element is bounded by its pair's norm. The scale is the least power of two whose 448 multiple
    covers the head's largest bound (times 1.01 for bf16 rounding)."""
    out = []
    for layer in layers:
        attn, g = layer.self_attn, layer.input_layernorm.weight.detach().float()
        bounds = []
        for proj, is_k in ((attn.k_proj, True), (attn.v_proj, False)):
            w = proj.weight.detach().float() * g[None, :]
            b = w.norm(dim=1) * math.sqrt(hidden)
            if proj.bias is not None:
                b = b + proj.bias.detach().float().abs()
            b = b.view(kv_heads, head_dim)
            if is_k:
                if qk_norm and attn.k_norm is not None:
                    b = math.sqrt(head_dim) * attn.k_norm.weight.detach().float().abs()[None, :].expand(
                        kv_heads, -1
                    )
                b = _rope_pairs(b, head_dim)
            bounds.append(b.amax(dim=1))
        out.append(torch.stack(bounds))
    return _pow2_at_least(torch.stack(out) * _KV_MARGIN).contiguous()


def kv_digest(scales: torch.Tensor) -> str:
    """16 hex digits naming a set of KV scales (what the KV layout carries so P and D can compare)."""
    return hashlib.sha256(scales.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
