"""Prefill attention on a GPU (backend/model/prefill_attention.py): flash, grouped K/V, and the masked
form after a cached prefix, against plain causal attention in float32 (GPU only; skipped on the CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.backend.model import prefill_attention as pa

pytestmark = pytest.mark.gpu


def _qkv(t: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, h, 64, generator=g).to(dtype).cuda() for h in (heads, kv_heads, kv_heads))


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [t, nh, hd] at positions start.. over k/v [start + t, kvh, hd], float32, the mask spelled out."""
    group, t = q.shape[1] // k.shape[1], q.shape[0]
    kh = k.float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vh = v.float().repeat_interleave(group, dim=1).transpose(0, 1)[None]
    mask = (
        torch.arange(start + t, device=q.device)[None, :]
        <= torch.arange(start, start + t, device=q.device)[:, None]
    )
    o = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], kh, vh, attn_mask=mask)
    return o[0].transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "start"), [(1, 0), (300, 0), (2048, 0), (17, 48), (300, 1024)])
def test_attend_gpu_is_causal_attention(dtype: torch.dtype, t: int, start: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    q, _, _ = _qkv(t, 32, 8, dtype, seed=t)
    _, k, v = _qkv(start + t, 32, 8, dtype, seed=t + 1)
    got = pa.attend_gpu(q, k, v, start)
    assert got.dtype == dtype and got.shape == (t, 32 * 64)
    torch.testing.assert_close(got.float(), _plain(q, k, v, start), atol=2e-2, rtol=2e-2)
