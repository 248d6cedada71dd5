"""The row step: how a family turns the decoder's last hidden state into one generated row per stream.

The engines (P's first row, D's and the monolithic engine's running batch) know rows, positions and
sampling parameters, never a family: they call a `RowStep`, and the family's object runs its head and
sampler. Two families:

- `TokenRowStep` (plain decoders, Orpheus): the decoder's head over the step's `VocabSpan`, then the
  batched sampler (penalty, grammar, temperature, top-k/p) at the new row's position; a row ends its
  stream when its column 0 is the stream's eos id (the model's) or one of its stop ids.
- `CsmRowStep` (Sesame CSM): the backbone's hidden state -> `CsmFrames.frame` (codebook 0 from the
  backbone's head, codebooks 1..N-1 from the depth decoder) -> one row of N codes with the text column
  absent, each code among Mimi's codes and the end (`CsmShape.mimi_codes`); frame f of a stream
  (f = the row's index among its generated rows, row 0 is P's) draws its codebook k at position
  f * N + k; a row ends its stream when it is CSM's end frame (`CsmFrames.ends`). Its repetition
  penalty is not supported (`has_history` False: Sesame's generator has none; the running batch
  keeps no history for it).

Positions: `starts[i]` is stream i's prompt length (the position of its row 0), `positions[i]` the
position of the row being made (P: the prompt length; the running batch: the previous row's + 1).

Called by one engine thread; nothing here waits for the device unless the method says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from tandem.backend.generation.sampling import SamplingParams, sample_on_device, step_span
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.csm_checkpoint import CsmModel
from tandem.backend.model.csm_frames import CsmFrames, frame_rows
from tandem.backend.model.cuda_graphs import GraphedDecode
from tandem.backend.model.decoder import Decoder, PrefillItem


class RowStep(Protocol):
    """A family's row maker over `decoder` (the model whose KV the engine's pool holds)."""

    @property
    def decoder(self) -> Decoder: ...

    @property
    def has_history(self) -> bool:
        """True when the repetition penalty applies (the running batch keeps each stream's ids)."""
        ...

    def first_rows(
        self,
        pool: KVPool,
        items: Sequence[PrefillItem],
        params: Sequence[SamplingParams],
        starts: Sequence[int],
    ) -> torch.Tensor:
        """One prefill forward over `items` (writes their KV, `Decoder.prefill_many`), then each
        item's row 0 sampled with params[i] at position starts[i]: LongTensor [n, W] on the CPU
        (waits for the device)."""
        ...

    def next_rows(
        self,
        rows: torch.Tensor,
        pool: KVPool,
        tables: Sequence[torch.Tensor],
        positions: torch.Tensor,
        params: Sequence[SamplingParams],
        starts: Sequence[int],
        seen: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decode step (`Decoder.decode`'s contract for rows [B, W], tables, positions [B] on the
        pool's device: the input rows' positions), then each stream's next row, made at position
        positions[i] + 1: LongTensor [B, W] on the pool's device (nothing waits for it). `seen`:
        the streams' histories (`sample_on_device`), None when no stream has a penalty."""
        ...

    def ends(self, row: np.ndarray, params: SamplingParams, eos_token_id: int | None) -> bool:
        """True when generated `row` [W] ends its stream (the row itself is the stream's last);
        `eos_token_id`: the stream's end id (`Stream.eos_token_id`: the model's), where the family
        ends on an id."""
        ...


class TokenRowStep:
    """`RowStep` of a plain decoder: head over the step's span, then the sampler (module docstring).
    `graphed`: the CUDA-graph replay of the decode step's layers, when the engine captures one."""

    has_history = True

    def __init__(self, decoder: Decoder, graphed: GraphedDecode | None = None) -> None:
        self._decoder = decoder
        self.graphed = graphed

    @property
    def decoder(self) -> Decoder:
        return self._decoder

    def first_rows(
        self,
        pool: KVPool,
        items: Sequence[PrefillItem],
        params: Sequence[SamplingParams],
        starts: Sequence[int],
    ) -> torch.Tensor:
        span = step_span(params, self._decoder.cfg.vocab_size)  # grammar-bound: the head's legal rows only
        logits = self._decoder.prefill_many(pool, items, span)
        return sample_on_device(logits, params, list(starts), span=span).cpu()

    def next_rows(
        self,
        rows: torch.Tensor,
        pool: KVPool,
        tables: Sequence[torch.Tensor],
        positions: torch.Tensor,
        params: Sequence[SamplingParams],
        starts: Sequence[int],
        seen: torch.Tensor | None,
    ) -> torch.Tensor:
        span = step_span(params, self._decoder.cfg.vocab_size)
        if self.graphed is not None:
            logits = self.graphed.decode(rows, tables, positions, span)
        else:
            logits = self._decoder.decode(rows, pool, tables, positions, span)
        at = [int(t.numel()) for t in tables]  # a table's length is its new row's position + 1
        return sample_on_device(logits, params, at, seen, span)

    def ends(self, row: np.ndarray, params: SamplingParams, eos_token_id: int | None) -> bool:
        last = int(row[0])
        return last == eos_token_id or params.stops(last)


class CsmRowStep:
    """`RowStep` of Sesame CSM (module docstring): the backbone is the engine's decoder; the depth
    decoder's pool (`CsmFrames`) holds `max_batch` seats, and a larger step runs in groups of it."""

    has_history = False

    def __init__(self, model: CsmModel, max_batch: int) -> None:
        self.model = model
        self.frames = CsmFrames(model, max(1, max_batch), codes=model.shape.mimi_codes)
        self._seats = max(1, max_batch)

    @property
    def decoder(self) -> Decoder:
        return self.model.backbone

    def _frames(
        self, h: torch.Tensor, params: Sequence[SamplingParams], numbers: Sequence[int]
    ) -> torch.Tensor:
        """Rows [B, N + 1] on the decoders' device of the frames made from hidden states h [B, H]."""
        out = []
        for lo in range(0, h.shape[0], self._seats):
            hi = lo + self._seats
            out.append(self.frames.frame(h[lo:hi], params[lo:hi], numbers[lo:hi]))
        codes = out[0] if len(out) == 1 else torch.cat(out)
        return frame_rows(codes)

    def first_rows(
        self,
        pool: KVPool,
        items: Sequence[PrefillItem],
        params: Sequence[SamplingParams],
        starts: Sequence[int],
    ) -> torch.Tensor:
        h = self.model.backbone.prefill_hidden(pool, items)
        return self._frames(h, params, [0] * len(items)).cpu()

    def next_rows(
        self,
        rows: torch.Tensor,
        pool: KVPool,
        tables: Sequence[torch.Tensor],
        positions: torch.Tensor,
        params: Sequence[SamplingParams],
        starts: Sequence[int],
        seen: torch.Tensor | None,
    ) -> torch.Tensor:
        h = self.model.backbone.decode_step_hidden(rows, pool, tables, positions)
        numbers = [int(t.numel()) - s for t, s in zip(tables, starts, strict=True)]
        return self._frames(h, params, numbers)

    def ends(self, row: np.ndarray, params: SamplingParams, eos_token_id: int | None) -> bool:
        codes = torch.as_tensor(np.asarray(row, dtype=np.int64)[None, : self.frames.codebooks])
        return bool(self.frames.ends(codes)[0])
