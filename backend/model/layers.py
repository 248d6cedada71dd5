"""Building blocks of the Llama/Qwen decoder, named exactly like Hugging Face's modules, so
`state_dict()` keys are the checkpoint's tensor names; numerics follow HF (RMSNorm in float32, RoPE
with `rotate_half`), so logits match transformers at 1e-4.

Fused projections: q/k/v and gate/up keep their HF parameters, as row-block views of one concatenated
weight per group (`fuse_linears`), so a GPU step runs one QKV and one gate-up GEMM; the CPU path runs
the separate projections.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.backend.model.config import ModelConfig

# A fused projection: the [sum of outputs, in] weight and its bias (None without one).
Fused = tuple[torch.Tensor, torch.Tensor | None]


def fuse_linears(linears: list[nn.Linear]) -> Fused:
    """Concatenate the linears' weights (and biases) along the output axis into one new tensor and make
    each linear's parameter a row-block view of it; returns (weight, bias).

    The parameters stay the same `nn.Parameter` objects (only their `.data` is re-pointed), so named
    parameters, `state_dict()` and in-place loads (`param.copy_`, `normal_`) see and fill the fused
    storage. Called by the modules below at construction, by `Decoder` after `to_empty`, and again by
    `_kept_fused` when something replaced a parameter's storage (a `.to()`, an assigning load).
    """
    with torch.no_grad():
        weight = torch.cat([lin.weight for lin in linears])
        bias = None
        if linears[0].bias is not None:
            bias = torch.cat([lin.bias for lin in linears if lin.bias is not None])
        off = 0
        for lin in linears:
            n = lin.out_features
            lin.weight.data = weight[off : off + n]
            if bias is not None and lin.bias is not None:
                lin.bias.data = bias[off : off + n]
            off += n
    return weight, bias


def _still_fused(fused: Fused, linears: list[nn.Linear]) -> bool:
    """True while every linear's parameters are still the row blocks of `fused` (cheap: pointers only)."""
    weight, bias = fused
    off = 0
    for lin in linears:
        if lin.weight.data_ptr() != weight.data_ptr() + off * weight.stride(0) * weight.element_size():
            return False
        if bias is not None and lin.bias is not None and lin.bias.data_ptr() != bias[off:].data_ptr():
            return False
        off += lin.out_features
    return True


def _kept_fused(fused: Fused, linears: list[nn.Linear]) -> Fused:
    """`fused` while the parameters still view it, else a new concatenation of their current values."""
    return fused if _still_fused(fused, linears) else fuse_linears(linears)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 and cast back, as HF's LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, head_dim] for absolute `positions` [N], computed in float32, cast to `dtype`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [N, heads, hd] by per-token tables `cos`/`sin` [N, hd]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    """Projections of one attention block; the attention itself runs in `Decoder` (it needs the pool)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, nh, kvh, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kvh, hd
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.attention_bias, dtype=dtype)
        self.k_proj = nn.Linear(h, kvh * hd, bias=cfg.attention_bias, dtype=dtype)
        self.v_proj = nn.Linear(h, kvh * hd, bias=cfg.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(nh * hd, h, bias=False, dtype=dtype)
        self.q_norm: RMSNorm | None = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(hd, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self._qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def fuse(self) -> None:
        """Rebuild the fused QKV weight (after the parameters moved, e.g. `Module.to_empty`)."""
        self._qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def projections(self) -> tuple[nn.Linear, ...]:
        """q, k, v, o: what FP8 quantises (`Decoder.quantize_fp8`)."""
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    def qkv_weight(self) -> Fused:
        """The fused [(nh + 2 kvh) * hd, H] weight (and bias) of q/k/v, in that order along the rows."""
        self._qkv = _kept_fused(self._qkv, [self.q_proj, self.k_proj, self.v_proj])
        return self._qkv

    def split_qkv(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`qkv` for the fused projection's output [N, (nh + 2 kvh) * hd]: the same q/k/v, torch ops."""
        n, nh, kvh, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([nh * hd, kvh * hd, kvh * hd], dim=-1)
        q, k, v = q.reshape(n, nh, hd), k.reshape(n, kvh, hd), v.reshape(n, kvh, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, nh, hd], k/v [N, kvh, hd] for tokens `x` [N, H], with qk-norm and RoPE applied."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)
        self._gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def fuse(self) -> None:
        """Rebuild the fused gate-up weight (after the parameters moved, e.g. `Module.to_empty`)."""
        self._gate_up = fuse_linears([self.gate_proj, self.up_proj])

    def projections(self) -> tuple[nn.Linear, ...]:
        """gate, up, down: what FP8 quantises (`Decoder.quantize_fp8`)."""
        return (self.gate_proj, self.up_proj, self.down_proj)

    def gate_up_weight(self) -> torch.Tensor:
        """The fused [2 * I, H] weight: gate's rows, then up's."""
        self._gate_up = _kept_fused(self._gate_up, [self.gate_proj, self.up_proj])
        return self._gate_up[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Body(nn.Module):
    """The `model.` part of an HF causal LM: embeddings (`embed_tokens`: the decoder's input table,
    `Decoder._make_embedding`), layers, final norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, embed_tokens: nn.Module) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
