"""Building blocks of the Llama/Qwen decoder, named exactly like Hugging Face's modules.

Why mirror HF names: the decoder's `state_dict()` keys are then the checkpoint's tensor names
(`model.layers.0.self_attn.q_proj.weight`, ...), so loading and saving real checkpoints needs no
renaming table. The numerics follow HF too (RMSNorm in float32, RoPE with `rotate_half`), which is what
lets the unit tests compare logits with transformers at 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


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
    """The `model.` part of an HF causal LM: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.row_width * cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
