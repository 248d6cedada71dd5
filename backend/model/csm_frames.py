"""CSM's frame step: one backbone step, then the depth decoder's N - 1 steps, for a batch of streams.

A frame of stream b is made from the backbone's final hidden state h_b at its last row: codebook 0
is sampled from the backbone's head; the depth decoder then restarts (position 0: h_b projected,
position 1: codebook 0's code) and samples codebooks 1..N-1, one batched step each, every stream of
the batch at the same depth position, so each step's head is one codebook's. The depth decoder's KV
lives in a pool of its own, N slots per batch seat, rewritten by every frame (it never outlives the
frame, never crosses P -> D and needs no prefix cache).

Codes: with `codes` set (the engines: the codec's codebook size, `CsmShape.mimi_codes`) every codebook
samples among ids 0..codes-1 only: Mimi's codes, CSM's codebook eos among them (0 in CSM-1B), never the
pad ids past them that no Mimi decodes; None samples the whole vocabulary, as transformers does.

Randomness: codebook k of frame f samples at position f * N + k of the stream's seed
(`backend/generation/sampling.py`: a pure function of seed, position, column), so a stream's codes
do not depend on its batch companions.

`generate` is the reference loop (one stream, pool-backed, the same calls an engine makes): prompt
rows -> backbone prefill -> frame, backbone decode of that frame's row, frame, ... until the end
frame (codebooks 0..N-2 all CSM's codebook eos id, transformers' rule; the end frame is returned)
or `max_frames`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.backend.generation.sampling import SamplingParams, sample_on_device
from tandem.backend.generation.vocab_span import VocabSpan
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.csm import ABSENT
from tandem.backend.model.csm_checkpoint import CsmModel
from tandem.backend.model.decoder import PrefillItem


class CsmFrames:
    """Makes frames for up to `max_batch` streams at a time; owns the depth decoder's pool. Used by
    one thread (the engine's loop, or `generate`)."""

    def __init__(
        self, model: CsmModel, max_batch: int, page_size: int = 16, codes: int | None = None
    ) -> None:
        """`codes`: sample among ids 0..codes-1 only (module docstring); None: the whole vocabulary."""
        self.model = model
        self.codebooks = model.shape.rows.codebooks
        vocab = model.shape.rows.codebook_vocab
        if codes is not None and not model.shape.codebook_eos < codes <= vocab:
            raise ValueError(f"codes {codes} must hold the codebook eos id and fit the vocabulary of {vocab}")
        self._span = None if codes is None or codes == vocab else VocabSpan(0, codes, vocab)
        depth = model.depth
        pages_per_seat = -(-self.codebooks // page_size)
        self.pool = KVPool(depth.kv_layout(), max_batch * pages_per_seat, page_size, device=depth.device)
        pages = self.pool.allocate(max_batch * pages_per_seat)
        # Seat b's N slots, fixed for the pool's life (each frame overwrites them).
        self._slots = [
            self.pool.slots(pages[b * pages_per_seat : (b + 1) * pages_per_seat], self.codebooks)
            for b in range(max_batch)
        ]

    @torch.inference_mode()
    def frame(self, h: torch.Tensor, params: Sequence[SamplingParams], frames: Sequence[int]) -> torch.Tensor:
        """Codes [B, N] (int64, on the decoders' device) of the next frame of B streams from the
        backbone's hidden states h [B, H] at their last rows; stream b samples with params[b] as
        its frame number frames[b]. Writes only the depth pool."""
        b, n = h.shape[0], self.codebooks
        if b > len(self._slots) or len(params) != b or len(frames) != b:
            raise ValueError(
                f"a frame step takes up to {len(self._slots)} streams with params and frame numbers"
            )
        backbone, depth = self.model.backbone, self.model.depth
        first = [f * n for f in frames]
        span = self._span
        # Logits of ids 0..codes-1 (span.lo is 0): sampled as a vocabulary of their own, same ids.
        code = sample_on_device(backbone.head_logits(h, span), params, first)[:, 0]
        codes = [code]
        embeds = depth.project(h)
        rows = depth.depth_rows(0, code)
        items = [PrefillItem(rows[i : i + 1], self._slots[i][:2], 0, embeds[i : i + 1]) for i in range(b)]
        hidden = depth.prefill_hidden(self.pool, items)
        for k in range(1, n):
            logits = depth.codebook_logits(hidden, k)
            if span is not None:
                logits = logits[:, :, : span.hi]
            code = sample_on_device(logits, params, [p + k for p in first])[:, 0]
            codes.append(code)
            if k + 1 < n:
                tables = [self._slots[i][: k + 2] for i in range(b)]
                positions = torch.full((b,), k + 1, dtype=torch.long)
                hidden = depth.decode_step_hidden(depth.depth_rows(k, code), self.pool, tables, positions)
        return torch.stack(codes, dim=1)

    def ends(self, codes: torch.Tensor) -> torch.Tensor:
        """Bool [B]: the frames [B, N] that end their streams (codebooks 0..N-2 all the eos id)."""
        return (codes[:, :-1] == self.model.shape.codebook_eos).all(dim=1)


def frame_rows(codes: torch.Tensor) -> torch.Tensor:
    """Frames [B, N] as backbone rows [B, N + 1] (the text column absent)."""
    return torch.cat([codes, torch.full_like(codes[:, :1], ABSENT)], dim=1)


@torch.inference_mode()
def generate(
    model: CsmModel,
    prompt: torch.Tensor,
    max_frames: int,
    params: SamplingParams,
    page_size: int = 16,
    codes: int | None = None,
) -> torch.Tensor:
    """The reference loop for one stream: frames [F, N] (CPU int64) after prompt rows [T, N + 1],
    F <= max_frames, the end frame included when one came; `codes` as `CsmFrames` takes it (module
    docstring)."""
    backbone = model.backbone
    total = prompt.shape[0] + max_frames
    pool = KVPool(backbone.kv_layout(), -(-total // page_size), page_size, device=backbone.device)
    slots = pool.slots(pool.allocate(pool.num_free_pages), total)
    maker = CsmFrames(model, 1, page_size, codes)
    t = prompt.shape[0]
    h = backbone.prefill_hidden(pool, [PrefillItem(prompt, slots[:t], 0)])
    out = []
    for f in range(max_frames):
        made = maker.frame(h, [params], [f])
        out.append(made[0].cpu())
        if bool(maker.ends(made)[0]) or f + 1 == max_frames:
            break
        pos = t + f
        h = backbone.decode_step_hidden(frame_rows(made), pool, [slots[: pos + 1]], torch.tensor([pos]))
    return torch.stack(out)
