"""CUDA-graph replay of the decode step (an eager step is dispatch-bound: docs/benchmarks).

Graphs are captured lazily per bucket (batch rounded up to a power of two, or to `max_batch` above
the largest power of two under it; context rounded up to `context_step`), over static input buffers.
Unused batch rows point at a scratch slot the graph owns (one pool page reserved at construction).

A graph holds the layers only (`Decoder.decode_hidden`); the output head runs after the replay, over
the bucket's hidden states, for the ids the step's streams need (`VocabSpan`: a grammar-bound step
reads the head's rows of its grammar's ids alone), so one capture serves every span and no span
needs a capture of its own. The head is one GEMM queued behind the replay on the same stream: no host
sync, and its input is the graph's static output, read before the next replay can write it.

Owner: the engine thread that calls `decode` (D or the monolithic engine); not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.backend.device import upload
from tandem.backend.generation.vocab_span import VocabSpan
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.decoder import Decoder

log = logging.getLogger("tandem")


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: powers of two below `max_batch`, then `max_batch`
    itself (so a batch between the largest power of two and max_batch replays a graph too)."""
    out, bb = [], 1
    while bb < max_batch:
        out.append(bb)
        bb *= 2
    return [*out, max_batch]


def batch_bucket(b: int, max_batch: int) -> int:
    """The bucket a batch of `b` (<= max_batch) replays: the smallest of `batch_buckets` >= b."""
    return next(bb for bb in batch_buckets(max_batch) if bb >= b) if b <= max_batch else b


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    rows: torch.Tensor
    padded: torch.Tensor
    lengths: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor  # [bb, H]: the final-normed hidden states the replay writes


class GraphedDecode:
    def __init__(self, decoder: Decoder, pool: KVPool, max_batch: int, context_step: int = 256) -> None:
        if pool.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA pool")
        self.decoder = decoder
        self.pool = pool
        self.context_step = context_step
        self.max_batch = max_batch
        self._scratch_page = pool.allocate(1)[0]  # held for the graph's lifetime
        self._scratch_slot = self._scratch_page * pool.page_size
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._mempool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device=pool.device)
        self.failed: str | None = None  # why capturing stopped (every step then runs eagerly)

    def warm_up(self, max_context: int) -> int:
        """Capture every bucket up to (max_batch, max_context) now, so no capture stalls live streams.

        Called once by the engine at start when configured; returns the number of graphs held.
        """
        for bb in batch_buckets(self.max_batch):
            for s in range(self.context_step, max_context + self.context_step, self.context_step):
                if (bb, s) not in self._graphs:
                    self._graphs[(bb, s)] = self._capture(bb, s)
        return len(self._graphs)

    def _bucket(self, b: int, longest: int) -> tuple[int, int]:
        s = -(-longest // self.context_step) * self.context_step
        return batch_bucket(b, self.max_batch), s

    def _capture(self, bb: int, s: int) -> _Graph:
        dev = self.pool.device
        w = self.decoder.cfg.row_width
        rows = torch.zeros(bb, w, dtype=torch.long, device=dev)
        padded = torch.full((bb, s), self._scratch_slot, dtype=torch.long, device=dev)
        lengths = torch.ones(bb, dtype=torch.long, device=dev)
        positions = torch.zeros(bb, dtype=torch.long, device=dev)
        # Warm up on a side stream (allocator and autotuning), then capture.
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._stream):
            for _ in range(2):
                self.decoder.decode_hidden(rows, self.pool, padded, lengths, positions)
        torch.cuda.current_stream(dev).wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: D's other threads (admission, the receiver's checksum) keep using CUDA on their
        # own streams while this thread captures; "global" would make their calls fail the capture.
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            hidden = self.decoder.decode_hidden(rows, self.pool, padded, lengths, positions)
        log.info("captured decode graph for batch %d, context %d", bb, s)
        return _Graph(graph, rows, padded, lengths, positions, hidden)

    def replay_of(
        self, b: int, longest: int, span: VocabSpan | None = None
    ) -> Callable[[], torch.Tensor] | None:
        """The device step a `decode` of `b` streams whose longest slot table has `longest` entries
        runs: the captured graph's replay, then the head over `span` (None: the whole vocabulary);
        None when that bucket is not captured yet. For benchmarks that time the device step alone: it
        reruns the last `decode`'s inputs (its KV write lands on the same slots again)."""
        g = self._graphs.get(self._bucket(b, longest))
        if g is None:
            return None
        graph, hidden = g.graph, g.hidden

        def step() -> torch.Tensor:
            graph.replay()
            return self.decoder.head_logits(hidden, span)

        return step

    @torch.inference_mode()
    def decode(
        self,
        rows: torch.Tensor,
        slot_tables: Sequence[torch.Tensor],
        positions: torch.Tensor,
        span: VocabSpan | None = None,
    ) -> torch.Tensor:
        """Same contract as `Decoder.decode` (returns fresh float32 logits [B, W, n] of `span`'s ids
        the caller owns)."""
        b = rows.shape[0]
        longest = max(int(t.numel()) for t in slot_tables)
        bb, s = self._bucket(b, longest)
        if b > self.max_batch or self.failed is not None:
            return self.decoder.decode(rows, self.pool, slot_tables, positions, span)
        g = self._graphs.get((bb, s))
        if g is None:
            try:
                g = self._graphs[(bb, s)] = self._capture(bb, s)
            except Exception as exc:  # a failed capture can leave the graph pool unusable: stop capturing
                self.failed = f"{type(exc).__name__}: {exc}"
                log.exception(
                    "capturing the decode graph for batch %d, context %d failed; decoding eagerly", bb, s
                )
                torch.cuda.synchronize(self.pool.device)
                return self.decoder.decode(rows, self.pool, slot_tables, positions, span)
        dev = self.pool.device
        g.rows.zero_()
        g.rows[:b].copy_(rows if rows.device == dev else upload(rows, dev))
        g.padded.fill_(self._scratch_slot)
        for i, t in enumerate(slot_tables):
            g.padded[i, : t.numel()].copy_(t, non_blocking=True)
        g.lengths.fill_(1)
        g.lengths[:b].copy_(upload(torch.tensor([int(t.numel()) for t in slot_tables]), dev))
        g.positions.zero_()
        g.positions[:b].copy_(positions if positions.device == dev else upload(positions, dev))
        g.graph.replay()
        # Over the whole bucket, as the head ran when it was inside the graph: the GEMM's shape (and
        # so its kernel and rounding) is the bucket's, whatever b is; the padding rows cost nothing
        # in a GEMM that streams its weight rows.
        return self.decoder.head_logits(g.hidden, span)[:b]
