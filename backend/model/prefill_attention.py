"""Prefill's causal attention of one prompt on a GPU (`attend_gpu`, called per prompt by
`attention.for_prefill`): torch's flash attention (grouped K/V where this torch supports it), or,
after a cached prefix, memory-efficient attention with a lower-right causal bias.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

__all__ = ["PREFILL_BACKENDS", "attend_gpu"]

log = logging.getLogger("tandem")

# Prefill's SDPA backends: flash (causal, no cached prefix) and memory-efficient (masked) kernels have
# no per-shape setup, while backends that build a plan per new sequence length (cuDNN attention) would
# pay it on the first prompt of every length a server sees. Math stays as the fallback of last resort.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# Whether flash attention takes grouped K/V itself (`enable_gqa`), per dtype, probed on the first GPU
# prefill of that dtype: where it does, K and V are not expanded to one copy per query head (2 x T x nh
# x hd per layer). Flash has no float32 kernel, so float32 always expands.
_FLASH_GQA: dict[torch.dtype, bool] = {}


def attend_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of one prompt on a GPU: q [t, nh, hd] over k/v [start + t, kvh, hd] -> [t, nh*hd].

    Fused kernels only: without a cached prefix flash attention (grouped K/V native where this torch
    supports it, else expanded per query head as HF's repeat_kv); with a prefix, a lower-right causal
    bias rather than a boolean mask, which flash and memory-efficient attention take without falling
    back to the math backend."""
    t, group = q.shape[0], q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    native = _FLASH_GQA.get(q.dtype)
    if not start and group > 1 and native is not False:
        kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        except RuntimeError:
            if native:
                raise
            _FLASH_GQA[q.dtype] = False
        else:
            _FLASH_GQA[q.dtype] = True
            return o[0].transpose(0, 1).reshape(t, -1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if start:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, start + t))
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return o[0].transpose(0, 1).reshape(t, -1)
