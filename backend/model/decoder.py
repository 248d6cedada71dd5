"""The audio-token LM: a Llama/Qwen2/Qwen3 decoder that reads and writes paged KV.

Its own implementation because attention must read K/V by slot from a shared `KVPool` (fragmented
pages, shared prefix pages) and batch unrelated sequences' decode steps; the maths is HF's, module for
module (`layers.py`), so checkpoints load unchanged and logits match transformers.

On a GPU the layers run fused (`_run_fused`, about ten kernels a layer: one QKV and one gate-up GEMM,
the `tandem.csrc.triton_ops` kernels, projections through `tandem.csrc.linear`); the CPU runs the torch
modules one by one (the unfused numbers). Rows of `row_width` (W) ids: `ModelConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn
from torch.nn.attention import sdpa_kernel

from tandem.backend.device import upload
from tandem.backend.generation.vocab_span import VocabSpan
from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.backend.model import attention, fp8
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.layers import Body, DecoderLayer, rope_cos_sin
from tandem.backend.model.prefill_attention import PREFILL_BACKENDS
from tandem.backend.model.rope import inv_freq as rope_inv_freq
from tandem.csrc import triton_ops
from tandem.csrc.fp8 import E4M3
from tandem.csrc.linear import linear

# attend(layer, q [N, nh, hd], k [N, kvh, hd], v [N, kvh, hd]) -> attention output [N, nh*hd]
_Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The fused step's form: attend(layer, qkv [N, (nh + 2 kvh) * hd] (the fused projection's output), cos,
# sin) -> attention output [N, nh*hd]; it applies qk-norm/RoPE and writes the KV itself.
_AttendQKV = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PrefillItem:
    """One prompt of a `Decoder.prefill_many` call: rows [T, W] at positions start..start+T-1 and the
    pool slot of every position 0..start+T-1 (positions < start already hold KV).

    `embeds` [E, H] (None: none): inputs already in the decoder's hidden space, at positions
    start..start+E-1 before the rows (which then start at start+E; rows may be [0, W]). CSM's depth
    decoder reads the backbone's hidden state this way (backend/model/csm.py)."""

    rows: torch.Tensor
    slots: torch.Tensor
    start: int
    embeds: torch.Tensor | None = None


class Decoder(nn.Module):
    """Llama/Qwen2/Qwen3 decoder: RMSNorm, RoPE (HF 'rotate_half', rope_theta), GQA, SwiGLU MLP, optional
    per-head q/k RMSNorm (Qwen3), qkv bias (Qwen2) and tied embeddings; rows of W ids (`ModelConfig`)."""

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
            self.model = Body(cfg, dtype, self._make_embedding(cfg, dtype))
            self.lm_head: nn.Linear | None = self._make_head(cfg, dtype)
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
        dev = self.device
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, dev)  # backend/model/rope.py
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer(
            "_col_offsets", torch.arange(cfg.row_width, device=dev) * cfg.vocab_size, persistent=False
        )
        # FP8 (`quantize_fp8`): the layers' E4M3 projections, and how the pool's K/V are stored.
        self.fp8_layers: list[fp8.Fp8Layer] | None = None
        self.fp8_emulate = False
        self.kv_access = attention.KVAccess()
        self._kv_digest = ""

    def _make_embedding(self, cfg: ModelConfig, dtype: torch.dtype) -> nn.Module:
        """The input table (built on the meta device): W columns of V ids in one [W*V, H] matrix.
        A family whose rows embed otherwise overrides this with `_embed` (backend/model/csm.py)."""
        return nn.Embedding(cfg.row_width * cfg.vocab_size, cfg.hidden_size, dtype=dtype)

    def _make_head(self, cfg: ModelConfig, dtype: torch.dtype) -> nn.Linear | None:
        """The output head (meta device): [W*V, H], or None when tied to the input table."""
        if cfg.tie_word_embeddings:
            return None
        return nn.Linear(cfg.hidden_size, cfg.row_width * cfg.vocab_size, bias=False, dtype=dtype)

    @classmethod
    def random(cls, cfg: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> Decoder:
        """Deterministic random weights for tests, benchmarks and the 'tiny' server model.

        Linear weights and biases ~ N(0, 0.02), norms = 1, and the head (or the tied embedding) ~
        N(0, 2/sqrt(H)) so that logits have a std of about 2 and sampling sees a non-degenerate
        distribution. Generated on `device` with a seeded torch.Generator (fast for 4B shapes on a GPU);
        the same seed on the same device type gives the same weights.
        """
        dec = cls(cfg, device)
        dev = dec.device
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
        """The KV layout this decoder reads and writes; pools passed to prefill/decode must match it
        (an E4M3 layout names its scales' digest, so pools of other scales do not)."""
        return replace(self.cfg.kv_layout(), scale_digest=self._kv_digest)

    @torch.no_grad()
    def quantize_fp8(self, weights: bool, kv: bool, emulate: bool = False) -> None:
        """Switch this (bf16) decoder to FP8, once, after its weights are loaded (backend/model/fp8.py).

        `weights`: every layer's projections to E4M3 with per-output-channel scales; the bf16 copies
        are released (the embedding/head table and the norms stay). `kv`: the KV layout becomes E4M3
        with per-(layer, K/V, KV head) scales derived from the weights, so pools must be made after
        this call. `emulate` (tests, CPU): the FP8 maths from dequantised operands instead of FP8
        kernels. Raises `fp8.Fp8Unsupported` where the device cannot run FP8 (unless emulating)."""
        if self.fp8_layers is not None or self.kv_access.scales is not None:
            raise ValueError("quantize_fp8: this decoder is already FP8")
        if not emulate:
            for flag, what in ((weights, "tandem.model.dtype"), (kv, "tandem.kv.dtype")):
                if flag:
                    fp8.require_fp8_device(self.device, what)
        if self.cfg.torch_dtype != torch.bfloat16 and not emulate:
            raise ValueError(f"FP8 computes in bfloat16; this decoder is {self.cfg.dtype}")
        layers = cast(Sequence[DecoderLayer], self.model.layers)
        cfg = self.cfg
        if kv:
            scales = fp8.kv_scales(layers, cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.qk_norm)
            self.kv_access = attention.KVAccess(scales, (1.0 / scales).contiguous())
            self._kv_digest = fp8.kv_digest(scales)
            self.cfg = replace(cfg, kv_dtype=str(E4M3).removeprefix("torch."))
        if weights:
            self.fp8_layers = [fp8.quantize_layer(layer) for layer in layers]
            self.fp8_emulate = emulate
            empty = torch.empty(0, dtype=cfg.torch_dtype, device=self.device)
            for layer in layers:
                for lin in (*layer.self_attn.projections(), *layer.mlp.projections()):
                    lin.weight.data = empty

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    # ---- shared pieces -------------------------------------------------------------------------------

    def _embed(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.ndim != 2 or rows.shape[1] != self.cfg.row_width:
            raise ValueError(f"rows must be [N, {self.cfg.row_width}], got {tuple(rows.shape)}")
        ids = rows.to(self.device, torch.long) + self._col_offsets
        return self.model.embed_tokens(ids).sum(dim=1)

    @torch.inference_mode()
    def head_logits(self, h: torch.Tensor, span: VocabSpan | None = None) -> torch.Tensor:
        """The output head over final-normed hidden states h [N, H] -> a fresh float32 [N, W, n]: the
        logits of ids span.lo .. span.hi - 1 (span None: the whole vocabulary, n = V).

        A span reads only the head's rows of its ids (a contiguous row slice of the [W*V, H] weight
        when W = 1; with W > 1 the whole head is computed and sliced). The matmul runs in the model
        dtype (fp32 accumulate, as HF does: an fp32 copy of a 152k-row head would cost 1.5 GB); with
        FP8 weights the head stays in it too (`quantize_fp8`)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        n, w, v = h.shape[0], self.cfg.row_width, self.cfg.vocab_size
        if span is not None and span.vocab_size != v:
            raise ValueError(f"{span} is not of this model's vocabulary of {v} ids")
        if span is None or span.is_whole:
            return linear(h, weight).float().view(n, w, v)
        if w == 1:
            return linear(h, weight[span.lo : span.hi]).float().view(n, 1, span.width)
        return linear(h, weight).float().view(n, w, v)[:, :, span.lo : span.hi]

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
        inv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The fused step's qk-norm + RoPE + KV write of `layer` (`triton_ops.rope_kv_write`): q returned,
        K and V written into `kv` (that layer of the pool) at `slots` (E4M3 at `inv_scales`' reciprocals
        for an E4M3 pool). Prefill passes 16 rows a program, a decode step 1 (each kind of call keeps
        its own, so a row never depends on its neighbours)."""
        attn = cast(Sequence[DecoderLayer], self.model.layers)[layer].self_attn
        qn = None if attn.q_norm is None else attn.q_norm.weight
        kn = None if attn.k_norm is None else attn.k_norm.weight
        return triton_ops.rope_kv_write(
            qkv,
            cos,
            sin,
            qn,
            kn,
            self.cfg.rms_norm_eps,
            kv,
            slots,
            self.cfg.num_heads,
            rows_per_program,
            inv_scales,
        )

    def _heads(self) -> attention.Heads:
        return attention.Heads(self.cfg.num_heads, self.cfg.num_kv_heads, self.cfg.head_dim)

    def _forward_layers(
        self, x: torch.Tensor, positions: torch.Tensor, att: attention.LayerAttention
    ) -> torch.Tensor:
        """The layers with one forward's attention: its fused form where the step runs fused."""
        if att.fused is not None and self._fused_on(x):
            return self._run_fused(x, positions, att.fused)
        return self._run(x, positions, att.unfused)

    def _run(self, x: torch.Tensor, positions: torch.Tensor, attend: _Attend) -> torch.Tensor:
        """The layers over embedded rows `x` [N, H] -> final-normed hidden states [N, H]; `attend` is the
        attention of each layer (it owns the pool writes). Fused on a GPU (`_run_fused`), and always
        with FP8 weights (whose CPU emulation runs the fused step's torch references)."""
        if self._fused_on(x) or self.fp8_layers is not None:

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
        if self.fp8_layers is not None:
            return fp8.run_layers(
                layers, self.fp8_layers, self.model.norm, x, cos, sin, attend, self.fp8_emulate
            )
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
            o = attention.sdpa(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, True
            )
            return o[0].transpose(0, 1).reshape(t, -1)

        return self.head_logits(self._run(x, torch.arange(t, device=x.device), attend))

    @torch.inference_mode()
    def prefill(
        self, rows: torch.Tensor, pool: KVPool, slots: torch.Tensor, start: int, span: VocabSpan | None = None
    ) -> torch.Tensor:
        """Run prompt rows [T, W] at positions start..start+T-1; return float32 logits [W, n] of the last one
        (the ids of `span`, `head_logits`; None: the whole vocabulary).

        Called by the prefill (and monolithic) engine. `slots` LongTensor[start+T] gives the pool slot of
        every position 0..start+T-1; positions < start must already hold KV (e.g. prefix-cache pages).
        Writes the KV of the T new positions into `pool` at `slots[start:]` (pages the caller owns and that
        nobody else reads as cached content). The caller owns the returned logits.
        """
        return self.prefill_many(pool, [PrefillItem(rows, slots, start)], span)[0]

    @torch.inference_mode()
    def prefill_many(
        self, pool: KVPool, items: Sequence[PrefillItem], span: VocabSpan | None = None
    ) -> torch.Tensor:
        """`prefill` for several unrelated prompts in one forward; returns float32 logits [n, W, width] of
        `span`'s ids (None: the whole vocabulary), row i the last position of item i. The linear layers
        run once over all rows, attention once per prompt, each prompt over itself only, so results do
        not depend on the other items. Items' slots must not overlap."""
        return self.head_logits(self.prefill_hidden(pool, items), span)

    @torch.inference_mode()
    def prefill_hidden(self, pool: KVPool, items: Sequence[PrefillItem]) -> torch.Tensor:
        """`prefill_many` without the head: the final-normed hidden states [n, H] (model dtype) of
        each item's last position, for a head the caller picks (CSM's backbone hands its to the depth
        decoder). Writes the items' KV as `prefill_many` does."""
        self._check_pool(pool)
        if not items:
            raise ValueError("prefill_many needs at least one item")
        xs, pos, new_slots, parts = [], [], [], []
        offset = 0
        dev = pool.device
        for it in items:
            x = self._embed(it.rows)
            if it.embeds is not None:
                x = torch.cat([it.embeds.to(x.device, x.dtype), x])
            t = x.shape[0]
            if t == 0:
                raise ValueError("a prefill item has no rows")
            if it.slots.numel() != it.start + t:
                raise ValueError(f"slots has {it.slots.numel()} entries, expected start+T = {it.start + t}")
            slots = it.slots.to(dev)
            xs.append(x)
            pos.append(torch.arange(it.start, it.start + t, device=x.device))
            new_slots.append(slots[it.start :])
            parts.append(attention.Part(offset, t, it.start, slots))
            offset += t
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        positions = pos[0] if len(pos) == 1 else torch.cat(pos)
        written = (new_slots[0] if len(new_slots) == 1 else torch.cat(new_slots)).contiguous()
        att = attention.for_prefill(pool, self.kv_access, parts, written, self._rope_kv_write)
        with sdpa_kernel(PREFILL_BACKENDS):
            h = self._forward_layers(x, positions, att)
        last = torch.tensor([p.offset + p.rows - 1 for p in parts], device=h.device)
        return h.index_select(0, last)

    @torch.inference_mode()
    def decode(
        self,
        rows: torch.Tensor,
        pool: KVPool,
        slot_tables: Sequence[torch.Tensor],
        positions: torch.Tensor,
        span: VocabSpan | None = None,
    ) -> torch.Tensor:
        """One step for B sequences; returns float32 logits [B, W, n] of `span`'s ids (None: the whole
        vocabulary, `head_logits`) the caller owns.

        Called by the decode (and monolithic) engine. rows [B, W] holds one new row per sequence,
        positions [B] the number of tokens already in the pool for each (= the new row's position), and
        slot_tables[i] LongTensor[positions[i]+1] the slots of sequence i with the new row's slot last.
        Writes each new row's KV into its slot; each sequence attends only over its own slots, padded to
        the longest context of the batch and masked, so results do not depend on batch companions.
        """
        return self.head_logits(self.decode_step_hidden(rows, pool, slot_tables, positions), span)

    @torch.inference_mode()
    def decode_step_hidden(
        self, rows: torch.Tensor, pool: KVPool, slot_tables: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> torch.Tensor:
        """`decode` without the head: the final-normed hidden states [B, H] (model dtype)."""
        self._check_pool(pool)
        b = rows.shape[0]
        if len(slot_tables) != b or positions.numel() != b:
            raise ValueError(f"batch of {b} rows needs {b} slot tables and positions")
        lengths_host = [int(t.numel()) for t in slot_tables]
        dev = pool.device
        lengths = upload(torch.tensor(lengths_host, dtype=torch.long), dev)
        padded = torch.nn.utils.rnn.pad_sequence([t.to(dev) for t in slot_tables], batch_first=True)
        return self.decode_hidden(rows.to(dev), pool, padded, lengths, positions.to(dev, torch.long))

    @torch.inference_mode()
    def decode_hidden(
        self,
        rows: torch.Tensor,
        pool: KVPool,
        padded: torch.Tensor,
        lengths: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """One step's layers with every input a device tensor of static shape: what a CUDA graph
        captures (the head runs after it, over whichever ids the step's streams need).

        padded LongTensor[B, S] holds each sequence's slots (its new row's slot at index lengths[i]-1;
        entries past it are ignored), lengths LongTensor[B], positions LongTensor[B], rows [B, W].
        No host synchronisation and no shape that depends on values, so one capture per (B, S) replays
        for any batch that fits. Writes the new rows' KV into the pool; returns the final-normed hidden
        states [B, H] in the model dtype.
        """
        att = attention.for_decode(
            pool,
            self.kv_access,
            self._heads(),
            padded,
            lengths,
            self.cfg.torch_dtype,
            self.paged_attention,
            self._rope_kv_write,
        )
        return self._forward_layers(self._embed(rows), positions, att)
