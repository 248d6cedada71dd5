"""The decoder's attention dispatch: per forward, which kernel each layer's attention runs and how the
new rows' K/V reach the paged pool.

`Decoder.prefill_many` and `Decoder.decode_hidden` build one `LayerAttention` per forward
(`for_prefill`, `for_decode`) and the layer loop calls, for every layer i, one of:
- `unfused(i, q, k, v)`: q [N, nh, hd], k/v [N, kvh, hd], qk-norm and RoPE already applied;
- `fused(i, qkv, cos, sin)` (None where the forward has no fused form): the QKV projection's output
  [N, (nh + 2 kvh) * hd]; qk-norm, RoPE and the K/V write in one kernel (`triton_ops.rope_kv_write`).
Either writes the N new rows' K/V into layer i of the pool at the forward's new slots (E4M3 at the
layer's per-head scales for an E4M3 pool, `KVAccess`) and returns the attention output [N, nh * hd].

What runs: prefill, per prompt, `prefill_attention.attend_gpu` on a GPU, masked SDPA on the CPU;
every path but a bf16 pool's unfused one reads the prompt's K/V back from the pool, so a cached and an
uncached prompt attend identically. Decode: the paged kernel reading K/V in place
(`kv_cuda.decode_attention`) where it is built for this shape and `Decoder.paged_attention` is on,
else a gather of each sequence's padded context and masked SDPA (no fused form).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.prefill_attention import attend_gpu
from tandem.csrc import kv_cuda
from tandem.csrc.fp8 import is_fp8, read_kv, write_kv

__all__ = ["Heads", "KVAccess", "LayerAttention", "Part", "RopeKVWrite", "for_decode", "for_prefill", "sdpa"]

# rope_kv_write(layer, qkv, cos, sin, kv of the layer, slots, rows_per_program, inverse scales or None) -> q
RopeKVWrite = Callable[
    [int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor | None],
    torch.Tensor,
]
Unfused = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Fused = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """SDPA over [B, heads, S, hd] with grouped-query K/V (kvh divides nh)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )


@dataclass(frozen=True)
class Heads:
    num_heads: int
    kv_heads: int
    head_dim: int

    @property
    def scale(self) -> float:
        return float(self.head_dim**-0.5)


@dataclass(frozen=True)
class KVAccess:
    """How a pool's bytes are written and read: in the compute dtype, or E4M3 at `scales` [L, 2, kvh]
    (float32 powers of two, `backend/model/fp8.kv_scales`; `inv_scales` their reciprocals)."""

    scales: torch.Tensor | None = None
    inv_scales: torch.Tensor | None = None

    def layer(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.scales is None or self.inv_scales is None:
            return None, None
        return self.scales[i], self.inv_scales[i]

    def write(self, kv: torch.Tensor, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(kv, slots, torch.stack((k, v)), self.layer(i)[1])

    def read(self, kv: torch.Tensor, i: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return read_kv(kv, slots, self.layer(i)[0], dtype)


@dataclass(frozen=True)
class LayerAttention:
    """One forward's attention, layer by layer (the module's contract)."""

    unfused: Unfused
    fused: Fused | None


@dataclass(frozen=True)
class Part:
    """One prompt of a prefill forward: its rows are [offset, offset + rows) of the forward's, at
    positions start.., and `slots` holds the slot of each of its positions 0..start+rows-1."""

    offset: int
    rows: int
    start: int
    slots: torch.Tensor


def _one_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """One prompt's attention: q [t, nh, hd] over k/v [start + t, kvh, hd] (its prefix first)."""
    t = q.shape[0]
    if q.is_cuda:
        return attend_gpu(q, k, v, start)
    mask = None
    if start:
        q_pos = torch.arange(start, start + t, device=q.device)
        mask = torch.arange(start + t, device=q.device)[None, :] <= q_pos[:, None]
    o = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, not start)
    return o[0].transpose(0, 1).reshape(t, -1)


def for_prefill(
    pool: KVPool, access: KVAccess, parts: Sequence[Part], written: torch.Tensor, rope_kv_write: RopeKVWrite
) -> LayerAttention:
    """Prefill of several prompts in one forward: `written` [sum of rows] the new rows' slots."""
    fp8 = is_fp8(pool.kv)

    def gathered(i: int, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        kv = pool.kv[i]
        outs = []
        for p in parts:
            both = access.read(kv, i, p.slots, dtype)
            outs.append(_one_prompt(q[p.offset : p.offset + p.rows], both[0], both[1], p.start))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def unfused(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = pool.kv[i]
        access.write(kv, i, written, k, v)
        if fp8:
            return gathered(i, q, q.dtype)
        outs = []
        for p in parts:
            kk, vv = k[p.offset : p.offset + p.rows], v[p.offset : p.offset + p.rows]
            if p.start:
                past = kv.index_select(1, p.slots[: p.start])
                kk, vv = torch.cat((past[0], kk)), torch.cat((past[1], vv))
            outs.append(_one_prompt(q[p.offset : p.offset + p.rows], kk, vv, p.start))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def fused(i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # qk-norm, RoPE and the KV write in one kernel (as the decode step), then each prompt's K/V
        # (prefix and new rows) gathered back from the pool in one copy.
        q = rope_kv_write(i, qkv, cos, sin, pool.kv[i], written, 16, access.layer(i)[1])
        return gathered(i, q, q.dtype)

    return LayerAttention(unfused, fused)


def for_decode(
    pool: KVPool,
    access: KVAccess,
    heads: Heads,
    padded: torch.Tensor,
    lengths: torch.Tensor,
    compute_dtype: torch.dtype,
    paged: bool,
    rope_kv_write: RopeKVWrite,
) -> LayerAttention:
    """One decode step of B sequences: padded [B, S] slots (the new row's at lengths[b] - 1), lengths
    [B]. `paged` (Decoder.paged_attention) asks for the in-place kernel; it runs where it is built for
    these heads, the compute dtype and the pool's dtype."""
    b, longest = padded.shape
    dev = pool.device
    if paged and kv_cuda.kernel_decodes(
        compute_dtype, dev, heads.num_heads, heads.kv_heads, heads.head_dim, kv_dtype=pool.kv.dtype
    ):
        new_slot = padded.gather(1, (lengths - 1)[:, None])[:, 0]

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            scales = access.layer(i)[0]
            return kv_cuda.decode_attention(q, pool.kv[i], padded, lengths, heads.scale, kv_scales=scales)

        def paged_unfused(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            access.write(pool.kv[i], i, new_slot, k, v)
            return attend(i, q).reshape(b, -1)

        def paged_fused(i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            q = rope_kv_write(i, qkv, cos, sin, pool.kv[i], new_slot, 1, access.layer(i)[1])
            return attend(i, q).reshape(b, -1)

        return LayerAttention(paged_unfused, paged_fused)

    cols = torch.arange(longest, device=dev)
    valid = cols[None, :] < lengths[:, None]
    # Pad with each sequence's own newest slot (always written) so masked reads stay finite.
    safe = padded.gather(1, torch.minimum(cols[None, :], lengths[:, None] - 1))
    new_slots = safe.gather(1, (lengths - 1)[:, None])[:, 0]
    flat = safe.reshape(-1)
    mask = valid[:, None, None, :]  # [B, 1, 1, S]

    def gathered(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = pool.kv[i]
        access.write(kv, i, new_slots, k, v)
        ctx = access.read(kv, i, flat, q.dtype).view(2, b, longest, *kv.shape[2:]).transpose(2, 3)
        o = sdpa(q[:, :, None, :], ctx[0], ctx[1], mask, False)  # [B, nh, 1, hd]
        return o.reshape(b, -1)

    return LayerAttention(gathered, None)
