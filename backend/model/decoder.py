"""The audio-token LM: a Llama/Qwen2/Qwen3 decoder that reads and writes paged KV.

Why its own implementation rather than transformers: the engines split prefill and decode across
processes and keep every sequence's KV in a shared `KVPool` addressed by slot, so attention must read
K/V by slot index (fragmented pages, prefix-cache pages shared between prompts) and batch decode steps of
unrelated sequences. HF's cache classes assume one contiguous cache per batch. The maths is HF's, module
for module (see `layers.py`), so real checkpoints load unchanged and logits match transformers.

On a GPU the layers run fused (`Decoder._run_fused`, about ten kernels a layer): one QKV and one gate-up
GEMM over weights concatenated at construction (`layers.fuse_linears`; the HF parameters view them),
the Triton kernels of `tandem.csrc.triton_ops`; every projection and the head go through
`tandem.csrc.linear` (cuBLAS, or at small batch and when enabled its CUDA GEMV). The CPU runs the
torch modules one by one, so its numbers (greedy tokens included) are the unfused ones.

Rows: a prompt or generated step is a row of `row_width` (W) ids. Column c is embedded with rows
c*V..c*V+V-1 of one [W*V, H] table and the W embeddings are summed; the head is one [W*V, H] matrix whose
logits reshape to [W, V]. W=1 is exactly an HF causal LM.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import sdpa_kernel

from tandem.backend.device import upload
from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.layers import Body, DecoderLayer, rope_cos_sin
from tandem.backend.model.prefill_attention import PREFILL_BACKENDS, attend_gpu
from tandem.backend.model.rope import inv_freq as rope_inv_freq
from tandem.csrc import kv_cuda, triton_ops
from tandem.csrc.linear import linear

# attend(layer, q [N, nh, hd], k [N, kvh, hd], v [N, kvh, hd]) -> attention output [N, nh*hd]
_Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The fused step's form: attend(layer, qkv [N, (nh + 2 kvh) * hd] (the fused projection's output), cos,
# sin) -> attention output [N, nh*hd]; it applies qk-norm/RoPE and writes the KV itself.
_AttendQKV = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool
) -> torch.Tensor:
    """SDPA over [B, heads, S, hd] with grouped-query K/V (kvh divides nh)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1]
    )


@dataclass(frozen=True)
class PrefillItem:
    """One prompt of a `Decoder.prefill_many` call: rows [T, W] at positions start..start+T-1 and the
    pool slot of every position 0..start+T-1 (positions < start already hold KV)."""

    rows: torch.Tensor
    slots: torch.Tensor
    start: int


class Decoder(nn.Module):
    """Llama/Qwen2/Qwen3 decoder: RMSNorm, RoPE (HF 'rotate_half' convention, rope_theta), GQA, SwiGLU MLP,
    optional per-head q/k RMSNorm (Qwen3 'qk_norm'), optional qkv bias (Qwen2), optional tied embeddings.
    Embedding: one [W*V, H] table; column c uses rows c*V..; the W embeddings are summed.
    Head: [W*V, H] -> logits [.., W, V]."""

    cfg: ModelConfig
    inv_freq: torch.Tensor
    _col_offsets: torch.Tensor

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        """Allocate (uninitialised) weights in `cfg.torch_dtype` on `device`; the module owns them.

        Called by `Decoder.random` and `checkpoint.load_checkpoint`, which fill the weights in. The
        parameters are created on the meta device first so a 4B-parameter model costs no CPU init time.
        """
        super().__init__()
        self.cfg = cfg
        dtype = cfg.torch_dtype
        with torch.device("meta"):
            self.model = Body(cfg, dtype)
            self.lm_head: nn.Linear | None = (
                None
                if cfg.tie_word_embeddings
                else nn.Linear(cfg.hidden_size, cfg.row_width * cfg.vocab_size, bias=False, dtype=dtype)
            )
        self.to_empty(device=device)
        for layer in cast(Sequence[DecoderLayer], self.model.layers):  # to_empty gave each its own storage
            layer.self_attn.fuse()
            layer.mlp.fuse()
        # Decode attention reads K/V in place with the compiled kernel when it exists for this shape
        # (`tandem.csrc.kv_cuda.kernel_decodes`); False forces the gather + SDPA path (setting
        # `tandem.batch.paged_attention`). Read when a step runs (or a CUDA graph is captured).
        self.paged_attention = True
        # On a GPU the step runs fused: one QKV and one gate-up GEMM per layer and the Triton kernels of
        # `tandem.csrc.triton_ops` (residual add + RMSNorm, qk-norm + RoPE + KV write, SwiGLU); False
        # runs the torch modules one by one (the reference; the CPU always does). Read when a step runs.
        self.fused = True
        dev = self.model.embed_tokens.weight.device
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dev)  # backend/model/rope.py
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer(
            "_col_offsets", torch.arange(cfg.row_width, device=dev) * cfg.vocab_size, persistent=False
        )

    @classmethod
    def random(cls, cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> Decoder:
        """Deterministic random weights for tests, benchmarks and the 'tiny' server model.

        Linear weights and biases ~ N(0, 0.02), norms = 1, and the head (or the tied embedding) ~
        N(0, 2/sqrt(H)) so that logits have a std of about 2 and sampling sees a non-degenerate
        distribution. Generated on `device` with a seeded torch.Generator (fast for 4B shapes on a GPU);
        the same seed on the same device type gives the same weights.
        """
        dec = cls(cfg, device)
        dev = dec.model.embed_tokens.weight.device
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        head_std = 2.0 / math.sqrt(cfg.hidden_size)
        with torch.no_grad():
            for name, param in dec.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                elif name in ("lm_head.weight",) or (cfg.tie_word_embeddings and "embed_tokens" in name):
                    param.normal_(0.0, head_std, generator=gen)
                else:
                    param.normal_(0.0, 0.02, generator=gen)
        return dec

    def kv_layout(self) -> KVLayout:
        """The KV layout this decoder reads and writes; pools passed to prefill/decode must match it."""
        return self.cfg.kv_layout()

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ---- shared pieces -------------------------------------------------------------------------------

    def _embed(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.ndim != 2 or rows.shape[1] != self.cfg.row_width:
            raise ValueError(f"rows must be [N, {self.cfg.row_width}], got {tuple(rows.shape)}")
        ids = rows.to(self.device, torch.long) + self._col_offsets
        return self.model.embed_tokens(ids).sum(dim=1)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype (fp32 accumulate, as HF does); keeping an fp32 copy of a
        # 152k-row head would cost 1.5 GB. The result is returned as float32.
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(h, weight).float().view(h.shape[0], self.cfg.row_width, self.cfg.vocab_size)

    def _fused_on(self, x: torch.Tensor) -> bool:
        return self.fused and triton_ops.available(x)

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim] for `positions`: the one place a step turns positions into RoPE angles."""
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def _rope_kv_write(
        self,
        layer: int,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        slots: torch.Tensor,
        rows_per_program: int,
    ) -> torch.Tensor:
        """The fused step's qk-norm + RoPE + KV write of `layer` (`triton_ops.rope_kv_write`): q returned,
        K and V written into `kv` (that layer of the pool) at `slots`. Prefill passes 16 rows a program,
        a decode step 1 (each kind of call keeps its own, so a row never depends on its neighbours)."""
        attn = cast(Sequence[DecoderLayer], self.model.layers)[layer].self_attn
        qn = None if attn.q_norm is None else attn.q_norm.weight
        kn = None if attn.k_norm is None else attn.k_norm.weight
        return triton_ops.rope_kv_write(
            qkv, cos, sin, qn, kn, self.cfg.rms_norm_eps, kv, slots, self.cfg.num_heads, rows_per_program
        )

    def _run(self, x: torch.Tensor, positions: torch.Tensor, attend: _Attend) -> torch.Tensor:
        """The layers over embedded rows `x` [N, H] -> final-normed hidden states [N, H]; `attend` is the
        attention of each layer (it owns the pool writes). Fused on a GPU (`_run_fused`)."""
        if self._fused_on(x):

            def attend_qkv(i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
                attn = cast(Sequence[DecoderLayer], self.model.layers)[i].self_attn
                return attend(i, *attn.split_qkv(qkv, cos, sin))

            return self._run_fused(x, positions, attend_qkv)
        cos, sin = self._rope_tables(positions, x.dtype)
        for i, layer in enumerate(cast(Sequence[DecoderLayer], self.model.layers)):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            x = x + layer.self_attn.o_proj(attend(i, q, k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def _run_fused(self, x: torch.Tensor, positions: torch.Tensor, attend: _AttendQKV) -> torch.Tensor:
        """`_run` on a GPU: per layer an add + RMSNorm, the QKV GEMM, attention (`attend`, which applies
        qk-norm/RoPE and writes the KV), o_proj, add + RMSNorm, the gate-up GEMM, SwiGLU, down_proj.
        The residual add of each block is fused into the norm that follows it."""
        cos, sin = self._rope_tables(positions, x.dtype)
        layers = cast(Sequence[DecoderLayer], self.model.layers)
        norm = layers[0].input_layernorm
        h, x = triton_ops.add_rms_norm(x, None, norm.weight, norm.eps)
        for i, layer in enumerate(layers):
            w, b = layer.self_attn.qkv_weight()
            o = attend(i, linear(h, w, b), cos, sin)
            post = layer.post_attention_layernorm
            o_proj, down = layer.self_attn.o_proj, layer.mlp.down_proj
            h, x = triton_ops.add_rms_norm(linear(o, o_proj.weight, o_proj.bias), x, post.weight, post.eps)
            up = triton_ops.swiglu(linear(h, layer.mlp.gate_up_weight()))
            norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, x = triton_ops.add_rms_norm(linear(up, down.weight, down.bias), x, norm.weight, norm.eps)
        return h

    def _check_pool(self, pool: KVPool) -> None:
        if pool.layout != self.kv_layout():
            raise ValueError(f"pool layout {pool.layout} does not match the model's {self.kv_layout()}")

    # ---- entry points --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Pool-free causal forward over rows [T, W] at positions 0..T-1 -> float32 logits [T, W, V].

        A reference path (tests, offline scoring); engines use `prefill`/`decode`. The caller owns the result.
        """
        x = self._embed(rows)
        t = x.shape[0]

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            o = _sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True)
            return o[0].transpose(0, 1).reshape(t, -1)

        return self._logits(self._run(x, torch.arange(t, device=x.device), attend))

    @torch.inference_mode()
    def prefill(self, rows: torch.Tensor, pool: KVPool, slots: torch.Tensor, start: int) -> torch.Tensor:
        """Run prompt rows [T, W] at positions start..start+T-1; return float32 logits [W, V] of the last one.

        Called by the prefill (and monolithic) engine. `slots` LongTensor[start+T] gives the pool slot of
        every position 0..start+T-1; positions < start must already hold KV (e.g. prefix-cache pages).
        Writes the KV of the T new positions into `pool` at `slots[start:]` (pages the caller owns and that
        nobody else reads as cached content). The caller owns the returned logits.
        """
        return self.prefill_many(pool, [PrefillItem(rows, slots, start)])[0]

    @torch.inference_mode()
    def prefill_many(self, pool: KVPool, items: Sequence[PrefillItem]) -> torch.Tensor:
        """`prefill` for several unrelated prompts in one forward; returns float32 logits [n, W, V], row i
        the last position of item i. Each prompt attends only to itself (its cached prefix and its own
        earlier rows), so results do not depend on the other items.

        Why: a prefill forward on a GPU costs about the same for 256 rows as for 2,048 (dispatch-bound,
        docs/benchmarks), so prompts that queue while one runs (a burst of clients, short prompts after
        a cached voice prefix) go through together: the linear layers run once over all rows, the
        attention once per prompt. Items' slots must not overlap.
        """
        self._check_pool(pool)
        if not items:
            raise ValueError("prefill_many needs at least one item")
        xs, pos, new_slots, parts = [], [], [], []
        offset = 0
        dev = pool.device
        for it in items:
            x = self._embed(it.rows)
            t = x.shape[0]
            if t == 0:
                raise ValueError("a prefill item has no rows")
            if it.slots.numel() != it.start + t:
                raise ValueError(f"slots has {it.slots.numel()} entries, expected start+T = {it.start + t}")
            slots = it.slots.to(dev)
            xs.append(x)
            pos.append(torch.arange(it.start, it.start + t, device=x.device))
            new_slots.append(slots[it.start :])
            parts.append((offset, t, it.start, slots))
            offset += t
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        positions = pos[0] if len(pos) == 1 else torch.cat(pos)
        written = (new_slots[0] if len(new_slots) == 1 else torch.cat(new_slots)).contiguous()
        on_gpu = x.device.type == "cuda"

        def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
            """One prompt's attention: q [t, nh, hd] over k/v [start + t, kvh, hd] (its prefix first)."""
            t = q.shape[0]
            if on_gpu:
                return attend_gpu(q, k, v, start)
            mask = None
            if start:
                q_pos = torch.arange(start, start + t, device=q.device)
                mask = torch.arange(start + t, device=q.device)[None, :] <= q_pos[:, None]
            o = _sdpa(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, not start
            )
            return o[0].transpose(0, 1).reshape(t, -1)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv = pool.kv[layer]
            kv.index_copy_(1, written, torch.stack((k, v)))
            outs = []
            for o, t, st, every in parts:
                kk, vv = k[o : o + t], v[o : o + t]
                if st:
                    past = kv.index_select(1, every[:st])
                    kk, vv = torch.cat((past[0], kk)), torch.cat((past[1], vv))
                outs.append(one(q[o : o + t], kk, vv, st))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        with sdpa_kernel(PREFILL_BACKENDS):
            if self._fused_on(x):

                def attend_fused(
                    layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
                    # qk-norm, RoPE and the KV write in one kernel (as the decode step), then each prompt's
                    # K/V (prefix and new rows) gathered back from the pool in one copy.
                    kv = pool.kv[layer]
                    q = self._rope_kv_write(layer, qkv, cos, sin, kv, written, rows_per_program=16)
                    outs = []
                    for o, t, st, every in parts:
                        both = kv.index_select(1, every)
                        outs.append(one(q[o : o + t], both[0], both[1], st))
                    return outs[0] if len(outs) == 1 else torch.cat(outs)

                h = self._run_fused(x, positions, attend_fused)
            else:
                h = self._run(x, positions, attend)
        last = torch.tensor([o + t - 1 for o, t, _, _ in parts], device=h.device)
        return self._logits(h.index_select(0, last))

    @torch.inference_mode()
    def decode(
        self, rows: torch.Tensor, pool: KVPool, slot_tables: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> torch.Tensor:
        """One step for B sequences; returns float32 logits [B, W, V] the caller owns.

        Called by the decode (and monolithic) engine. rows [B, W] holds one new row per sequence,
        positions [B] the number of tokens already in the pool for each (= the new row's position), and
        slot_tables[i] LongTensor[positions[i]+1] the slots of sequence i with the new row's slot last.
        Writes each new row's KV into its slot; each sequence attends only over its own slots, padded to
        the longest context of the batch and masked, so results do not depend on batch companions.
        """
        self._check_pool(pool)
        b = rows.shape[0]
        if len(slot_tables) != b or positions.numel() != b:
            raise ValueError(f"batch of {b} rows needs {b} slot tables and positions")
        lengths_host = [int(t.numel()) for t in slot_tables]
        dev = pool.device
        lengths = upload(torch.tensor(lengths_host, dtype=torch.long), dev)
        padded = torch.nn.utils.rnn.pad_sequence([t.to(dev) for t in slot_tables], batch_first=True)
        return self.decode_padded(rows.to(dev), pool, padded, lengths, positions.to(dev, torch.long))

    @torch.inference_mode()
    def decode_padded(
        self,
        rows: torch.Tensor,
        pool: KVPool,
        padded: torch.Tensor,
        lengths: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """`decode` with every input a device tensor of static shape: what a CUDA graph captures.

        padded LongTensor[B, S] holds each sequence's slots (its new row's slot at index lengths[i]-1;
        entries past it are ignored), lengths LongTensor[B], positions LongTensor[B], rows [B, W].
        No host synchronisation and no shape that depends on values, so one capture per (B, S) replays
        for any batch that fits. Writes the new rows' KV into the pool; returns float32 [B, W, V].
        """
        x = self._embed(rows)
        b, longest = padded.shape
        dev = pool.device
        cfg = self.cfg
        if self.paged_attention and kv_cuda.kernel_decodes(
            pool.kv.dtype, dev, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ):
            new_slot = padded.gather(1, (lengths - 1)[:, None])[:, 0]
            scale = cfg.head_dim**-0.5
            if self._fused_on(x):

                def attend_fused(
                    layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> torch.Tensor:
                    kv = pool.kv[layer]
                    q = self._rope_kv_write(layer, qkv, cos, sin, kv, new_slot, rows_per_program=1)
                    return kv_cuda.decode_attention(q, kv, padded, lengths, scale).reshape(b, -1)

                return self._logits(self._run_fused(x, positions, attend_fused))

            def attend_in_place(
                layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
                kv = pool.kv[layer]
                kv.index_copy_(1, new_slot, torch.stack((k, v)))
                return kv_cuda.decode_attention(q, kv, padded, lengths, scale).reshape(b, -1)

            return self._logits(self._run(x, positions, attend_in_place))
        cols = torch.arange(longest, device=dev)
        valid = cols[None, :] < lengths[:, None]
        # Pad with each sequence's own newest slot (always written) so masked reads stay finite.
        padded = padded.gather(1, torch.minimum(cols[None, :], lengths[:, None] - 1))
        new_slots = padded.gather(1, (lengths - 1)[:, None])[:, 0]
        flat = padded.reshape(-1)
        mask = valid[:, None, None, :]  # [B, 1, 1, S]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kv = pool.kv[layer]
            kv.index_copy_(1, new_slots, torch.stack((k, v)))
            ctx = kv.index_select(1, flat).view(2, b, longest, *kv.shape[2:]).transpose(2, 3)
            o = _sdpa(q[:, :, None, :], ctx[0], ctx[1], mask, False)  # [B, nh, 1, hd]
            return o.reshape(b, -1)

        h = self._run(x, positions, attend)
        return self._logits(h)
