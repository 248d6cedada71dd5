"""The running batch: one decode step over every admitted stream, and chunk emission.

Shared by the monolithic engine and by D. The owner (one engine thread) adds streams whose prompt
KV already sits in the pool together with their first generated row, then calls `step()` in a loop.
A stream leaves the batch when it finishes (final chunk emitted, `release` called once) or when its
client is gone (`cancelled`, `release` called once). Pages are reserved at admission for the prompt
plus `max_new_rows`, so a step never allocates and a running stream can never be starved of pages.

A step is `launch()` (inputs up, the forward and the sampling queued on the device; nothing waits)
then `finish()` (the one wait for the device: the sampled rows come back, chunks go out, finished
streams leave). An owner may do host work between the two while the device runs the step — D admits,
polls transfers and queues scatters there — but must not add to or remove from the step's streams;
streams added meanwhile join the next launch. `step()` is both with nothing between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tandem.backend.cuda_graphs import GraphedDecode
from tandem.backend.decoder import Decoder
from tandem.backend.errors import Cancelled, StreamFailed
from tandem.backend.kv_pool import KVPool
from tandem.backend.metrics import MetricsSink
from tandem.backend.sampling import sample_on_device
from tandem.backend.stream import Chunk, Stream, StreamStatus
from tandem.backend.vocoder import ChunkPolicy

log = logging.getLogger("tandem")

# How often (in steps) running streams are asked whether their client is still there.
_CANCEL_CHECK_EVERY = 8


@dataclass
class LaunchedStep:
    """A step queued on the device: its streams and their sampled rows (still on the device)."""

    streams: list[Stream]
    rows: torch.Tensor  # [B, W] on the pool's device
    started_s: float
    device_s: float = 0.0  # CPU: the compute already done in launch
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: around the queued work


class DecodeBatch:
    def __init__(
        self,
        decoder: Decoder,
        pool: KVPool,
        chunking: ChunkPolicy,
        metrics: MetricsSink,
        rate_floor_tok_s: float,
        cuda_graphs: bool = False,
        max_batch: int = 64,
        graph_warmup_context: int = 0,
    ) -> None:
        self.decoder = decoder
        self._graphed = None
        if cuda_graphs and pool.device.type == "cuda":
            self._graphed = GraphedDecode(decoder, pool, max_batch)
            if graph_warmup_context > 0:
                n = self._graphed.warm_up(graph_warmup_context)
                log.info(
                    "captured %d decode graphs up to batch %d, context %d", n, max_batch, graph_warmup_context
                )
        self.pool = pool
        self.chunking = chunking
        self.metrics = metrics
        self.rate_floor = rate_floor_tok_s
        self.streams: list[Stream] = []
        self._releases: dict[int, Callable[[], None]] = {}
        self._first_emit_s: dict[int, float] = {}
        self._first_rows: dict[int, int] = {}
        self._steps = 0
        self.device_busy_s = 0.0  # summed device time of finished steps (`LaunchedStep.device_s`)

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def graphs_failed(self) -> bool:
        """A CUDA-graph capture failed and every step now runs eagerly (~10x slower on a GPU)."""
        return self._graphed is not None and self._graphed.failed is not None

    def add(self, stream: Stream, first_row: np.ndarray, release: Callable[[], None]) -> None:
        """Join a stream whose prompt KV is in the pool; `release` frees its pages exactly once."""
        assert stream.slots is not None
        stream.status = StreamStatus.RUNNING
        stream.generated.append(np.asarray(first_row, dtype=np.int64).reshape(-1))
        self.streams.append(stream)
        self._releases[id(stream)] = release
        self._after_rows(stream)

    def step(self) -> float:
        """Run one decode step over every running stream; returns the step's wall time in seconds."""
        launched = self.launch()
        return 0.0 if launched is None else self.finish(launched)

    def launch(self) -> LaunchedStep | None:
        """Drop cancelled streams, then queue one step over every running stream (None if there is
        none). Returns without waiting for the device; `finish` must follow before the next launch."""
        if self._steps % _CANCEL_CHECK_EVERY == 0:
            for s in [s for s in self.streams if s.sink.cancelled()]:
                s.status = StreamStatus.CANCELLED
                self.metrics.inc("tandem_streams_total", outcome="cancelled")
                try:  # the final (CANCELLED) response: without one Triton never releases the request
                    s.sink.fail(Cancelled("client cancelled the stream"))
                except Exception:
                    log.exception("could not close cancelled stream %d", s.stream_id)
                finally:
                    self._leave(s)
        self._steps += 1
        active = list(self.streams)
        if not active:
            return None
        t0 = time.perf_counter()
        device = self.pool.device
        events = None
        if device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(torch.cuda.current_stream(device))
        rows = torch.from_numpy(np.stack([s.generated[-1] for s in active])).to(device)
        positions = [s.position for s in active]
        tables = [s.slots[: p + 1] for s, p in zip(active, positions, strict=True)]
        pos = torch.tensor(positions, device=device)
        if self._graphed is not None:
            logits = self._graphed.decode(rows, tables, pos)
        else:
            logits = self.decoder.decode(rows, self.pool, tables, pos)
        rows_dev = sample_on_device(logits, [s.sampling for s in active], [p + 1 for p in positions])
        if events is not None:
            events[1].record(torch.cuda.current_stream(device))
            return LaunchedStep(active, rows_dev, t0, events=events)
        return LaunchedStep(active, rows_dev, t0, device_s=time.perf_counter() - t0)

    def finish(self, launched: LaunchedStep) -> float:
        """Wait for the launched step, append each stream's row, emit due chunks, let finished streams
        go. Returns the wall time from launch to now (host work done in between included: it is
        what every stream's rate sees)."""
        new_rows = launched.rows.cpu().numpy()
        if launched.events is not None:  # synchronised by the copy above
            launched.device_s = launched.events[0].elapsed_time(launched.events[1]) / 1e3
        self.device_busy_s += launched.device_s
        for s, row in zip(launched.streams, new_rows, strict=True):
            if s.status is not StreamStatus.RUNNING:  # failed while the step ran (fail_all)
                continue
            s.generated.append(row)
            self._after_rows(s)
        elapsed = time.perf_counter() - launched.started_s
        self.metrics.observe("tandem_step_ms", elapsed * 1e3)
        return elapsed

    def fail_all(self, reason: str) -> None:
        """Every stream fails and leaves (pages released), even if one client's sink raises."""
        for s in list(self.streams):
            s.status = StreamStatus.FAILED
            try:
                s.sink.fail(StreamFailed(reason))
            except Exception:
                log.exception("could not tell stream %d that it failed", s.stream_id)
            finally:
                self._leave(s)

    def _after_rows(self, s: Stream) -> None:
        done = s.done_generating
        pending = len(s.generated) - s.emitted_rows
        if not done and pending < self.chunking.next_size(s.chunk_index):
            return
        rows = np.stack(s.generated[s.emitted_rows :])
        now = time.perf_counter()
        if id(s) not in self._first_emit_s:
            self._first_emit_s[id(s)] = now
            self._first_rows[id(s)] = len(s.generated)
        if s.chunk_index == 0:
            s.timings.mark("first_chunk")
        if done:
            s.timings.mark("last_chunk")
        chunk = Chunk(rows=rows, first_row=s.emitted_rows, final=done, timings=s.timings if done else None)
        s.emitted_rows = len(s.generated)
        s.chunk_index += 1
        s.sink.emit(chunk)
        if done:
            s.status = StreamStatus.FINISHED
            self._account_rate(s, now)
            self.metrics.inc("tandem_streams_total", outcome="finished")
            self._leave(s)

    def _account_rate(self, s: Stream, now: float) -> None:
        """Rows/s after the first chunk (the client's playback clock starts there) against the floor."""
        first = self._first_emit_s.get(id(s), now)
        n = len(s.generated) - self._first_rows.get(id(s), 0)
        if n > 0 and now > first and n / (now - first) < self.rate_floor:
            self.metrics.inc("tandem_streams_below_floor_total")

    def _leave(self, s: Stream) -> None:
        self.streams.remove(s)
        self._first_emit_s.pop(id(s), None)
        self._first_rows.pop(id(s), None)
        self._releases.pop(id(s))()
