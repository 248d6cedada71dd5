"""The running batch: one decode step over every admitted stream, and chunk emission.

Shared by the monolithic engine and D; one engine thread owns it. It adds streams whose prompt KV
and first row are in the pool, then calls `advance()` in a loop. A stream leaves when it finishes
or its client is gone; its `release` (pages back) runs exactly once, when no queued step can still
write its KV. Pages for the prompt plus `max_new_rows` are reserved at admission, so a step never
allocates.

`advance()` queues step n+1 (its input rows: step n's sampled rows, still on the device) before it
waits for step n, so the device never waits for the host (docs/architecture.md, "Threads and
ownership"). Consequences: a stream that ends at step n has one dropped row in step n+1, which
still writes its last KV (hence the late `release`); a stream joining between two calls misses the
step already queued. Tokens equal a serial loop's: sampling depends on (seed, position, column) only.

At most one step is queued between calls; `drain()` waits for it; `step()` is `advance()` then
`drain()`. On the CPU the forward runs inside `advance()`, in the same order.

Chunks: a stream's rows leave once they fill the size its `ChunkPolicy` chose when the chunk before
left, from the lead a real-time listener then had (backend/codec/chunking.py), read on `clock`.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.backend.codec.chunking import ChunkPolicy
from tandem.backend.device import upload
from tandem.backend.engines.stream import Chunk, Stream, StreamStatus
from tandem.backend.errors import Cancelled, StreamFailed
from tandem.backend.generation.sampling import mark_seen
from tandem.backend.kv.pool import KVPool
from tandem.backend.metrics import MetricsSink
from tandem.backend.model.cuda_graphs import GraphedDecode
from tandem.backend.model.decoder import Decoder
from tandem.backend.model.row_step import RowStep, TokenRowStep
from tandem.backend.scheduling.step_plan import Member, checks_cancellation, plan_step

log = logging.getLogger("tandem")


@dataclass
class QueuedStep:
    """A step queued on the device and not yet finished."""

    streams: list[Stream]
    rows: torch.Tensor  # [B, W] sampled rows on the pool's device: the next step's inputs
    host_rows: torch.Tensor  # [B, W] the same rows on the host (CUDA: pinned, valid once `ready` passed)
    context: int  # sum over streams of (position + 1): the KV tokens the step attends over
    started_s: float  # perf_counter when it was queued
    members: frozenset[int]  # id() of its streams
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # CUDA: around its device work
    cpu_s: float = 0.0  # CPU: the forward's wall time (it ran inside `_launch`)
    deferred: list[Callable[[], None]] = field(default_factory=list)  # releases waiting for this step


@dataclass(frozen=True)
class FinishedStep:
    """What one finished step measured (the owner feeds it to the step-time model)."""

    batch: int  # streams the step computed a row for (dropped rows of ended streams included)
    context: int
    seconds: float  # wall time this step added to its streams' clocks: from the previous step's
    # finish (or its own queueing, whichever is later) to its own finish
    device_s: float  # CUDA: device time between the step's events; CPU: the forward's wall time


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
        clock: Callable[[], float] = time.perf_counter,
        row_step: RowStep | None = None,
    ) -> None:
        """`row_step`: the family's row maker over `decoder` (None: a plain decoder's head and
        sampler, `TokenRowStep`, with the CUDA graphs `cuda_graphs` asks for; another family's step
        runs its own layers eagerly)."""
        self.decoder = decoder
        self._graphed = None
        if cuda_graphs and pool.device.type == "cuda" and row_step is None:
            self._graphed = GraphedDecode(decoder, pool, max_batch)
            if graph_warmup_context > 0:
                n = self._graphed.warm_up(graph_warmup_context)
                log.info(
                    "captured %d decode graphs up to batch %d, context %d", n, max_batch, graph_warmup_context
                )
        self.rows: RowStep = TokenRowStep(decoder, self._graphed) if row_step is None else row_step
        self.pool = pool
        self.chunking = chunking
        self._clock = clock  # chunk emission: the listener's lead and the rate after the first chunk
        self.metrics = metrics
        self.rate_floor = rate_floor_tok_s
        self.streams: list[Stream] = []
        self._releases: dict[int, Callable[[], None]] = {}
        self._first_emit_s: dict[int, float] = {}
        self._first_rows: dict[int, int] = {}
        self._queued: list[QueuedStep] = []  # launch order; one between advance() calls, two inside
        self._last_finish_s = 0.0
        self._steps = 0
        self.device_busy_s = 0.0  # summed device time of finished steps (`FinishedStep.device_s`)

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def graphs_failed(self) -> bool:
        """A CUDA-graph capture failed and every step now runs eagerly (~10x slower on a GPU)."""
        return self._graphed is not None and self._graphed.failed is not None

    @property
    def in_flight(self) -> bool:
        """A step is queued and not finished (the next `advance()` or `drain()` finishes it)."""
        return bool(self._queued)

    @property
    def queued_context(self) -> int:
        """Context of the queued step (0 when none): what the running batch attends over now."""
        return self._queued[-1].context if self._queued else 0

    def add(self, stream: Stream, first_row: np.ndarray, release: Callable[[], None]) -> None:
        """Join a stream whose prompt KV is in the pool; `release` frees its pages exactly once.
        It joins the next step queued (not one already queued)."""
        assert stream.slots is not None
        stream.status = StreamStatus.RUNNING
        stream.generated.append(np.asarray(first_row, dtype=np.int64).reshape(-1))
        stream.frames = self.chunking.framing.track(stream.generated[0].shape[0])
        stream.chunk_rows = self.chunking.next_rows(0, None)
        if stream.sampling.penalised and self.rows.has_history:  # the penalty's history starts with row 0
            stream.seen = self._no_history()
            mark_seen(stream.seen[None], upload(stream.generated[-1][None], self.pool.device))
        self.streams.append(stream)
        self._releases[id(stream)] = release
        self._after_rows(stream)

    def advance(self) -> FinishedStep | None:
        """Queue the next step over every stream that needs a row, then wait for the step queued
        before it and hand out its rows. Returns that step's figures (None if none was queued)."""
        prev = self._queued[-1] if self._queued else None
        self._launch(prev)
        return None if prev is None else self._finish(prev)

    def drain(self) -> FinishedStep | None:
        """Wait for the queued step, if any, and hand out its rows (nothing new is queued)."""
        return self._finish(self._queued[0]) if self._queued else None

    def step(self) -> float:
        """One whole step: when it returns every running stream has its next row (or has ended).
        Returns the wall time of the last step it finished (0.0 if there was none)."""
        done = [self.advance(), self.drain()]
        return next((d.seconds for d in reversed(done) if d is not None), 0.0)

    def _launch(self, prev: QueuedStep | None) -> QueuedStep | None:
        """The step's plan (`plan_step`: which streams leave, their client gone, and which need a row
        after the rows already queued), run: the cancelled leave, one step is queued for the rest
        (None if there is none). Nothing here waits for the device."""
        assert len(self._queued) <= 1, "at most one step is queued between advance() calls"
        ahead = {} if prev is None else {id(s): i for i, s in enumerate(prev.streams)}
        check = checks_cancellation(self._steps)
        self._steps += 1
        streams = list(self.streams)
        plan = plan_step(
            [
                Member(len(s.generated) + (id(s) in ahead), s.max_new_rows, check and s.sink.cancelled())
                for s in streams
            ]
        )
        for s in (streams[i] for i in plan.leave):
            s.status = StreamStatus.CANCELLED
            self.metrics.inc("tandem_streams_total", outcome="cancelled")
            try:  # the final (CANCELLED) response: without one Triton never releases the request
                s.sink.fail(Cancelled("client cancelled the stream"))
            except Exception:
                log.exception("could not close cancelled stream %d", s.stream_id)
            finally:
                self._leave(s)
        active = [streams[i] for i in plan.step]
        if not active:
            return None
        t0 = time.perf_counter()
        device = self.pool.device
        events = None
        if device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record(torch.cuda.current_stream(device))
        positions = [s.position + (id(s) in ahead) for s in active]
        rows = self._input_rows(active, prev, ahead)
        tables = [s.slots[: p + 1] for s, p in zip(active, positions, strict=True)]
        pos = upload(np.asarray(positions, dtype=np.int64), device)
        params = [s.sampling for s in active]
        seen = self._seen(active)
        starts = [s.prompt_len for s in active]
        rows_dev = self.rows.next_rows(rows, self.pool, tables, pos, params, starts, seen)
        if seen is not None:  # the next step's history, ordered on the device after this step's rows
            mark_seen(seen, rows_dev)
            for s, row in zip(active, seen, strict=True):
                s.seen = row if s.seen is not None else None
        host_rows = rows_dev
        if events is not None:  # the rows come back behind this step, ahead of the next one
            host_rows = torch.empty(rows_dev.shape, dtype=rows_dev.dtype, pin_memory=True)
            host_rows.copy_(rows_dev, non_blocking=True)
            events[1].record(torch.cuda.current_stream(device))
        queued = QueuedStep(
            streams=active,
            rows=rows_dev,
            host_rows=host_rows,
            context=sum(p + 1 for p in positions),
            started_s=t0,
            members=frozenset(id(s) for s in active),
            events=events,
            cpu_s=0.0 if events is not None else time.perf_counter() - t0,
        )
        self._queued.append(queued)
        return queued

    def _no_history(self) -> torch.Tensor:
        cfg = self.decoder.cfg
        return torch.zeros((cfg.row_width, cfg.vocab_size), dtype=torch.bool, device=self.pool.device)

    def _seen(self, active: list[Stream]) -> torch.Tensor | None:
        """Bool [B, W, V]: the ids each active stream generated (a stream without a repetition
        penalty contributes zeros), or None when no active stream has a penalty. Streams keep views
        of it (`Stream.seen`), so the next step's history follows this step's on the device."""
        if all(s.seen is None for s in active):
            return None
        blank = self._no_history()  # one [W, V] row shared by the streams without a penalty
        return torch.stack([blank if s.seen is None else s.seen for s in active])

    def _input_rows(
        self, active: list[Stream], prev: QueuedStep | None, ahead: dict[int, int]
    ) -> torch.Tensor:
        """[B, W] input rows on the device: a stream's row from `prev` (still on the device) when it
        has one queued there, else its last generated row (host)."""
        device = self.pool.device
        if (
            prev is not None
            and len(active) == len(prev.streams)
            and all(map(operator.is_, active, prev.streams))
        ):
            return prev.rows  # the steady state: the same streams, in the same order
        fresh = [s for s in active if id(s) not in ahead]
        host = upload(np.stack([s.generated[-1] for s in fresh]), device) if fresh else None
        if len(fresh) == len(active):  # none has a row queued (always so when nothing is queued)
            assert host is not None
            return host
        assert prev is not None
        base = prev.rows.shape[0]
        order, k = [], 0
        for s in active:
            if id(s) in ahead:
                order.append(ahead[id(s)])
            else:
                order.append(base + k)
                k += 1
        source = prev.rows if host is None else torch.cat([prev.rows, host])
        return source.index_select(0, upload(np.asarray(order, dtype=np.int64), device))

    def _finish(self, queued: QueuedStep) -> FinishedStep:
        """Wait for the oldest queued step, run the releases that waited for it, append each of its
        streams' rows, emit due chunks, let finished streams go."""
        assert self._queued and self._queued[0] is queued, "steps finish in launch order"
        device_s = queued.cpu_s
        if queued.events is not None:
            queued.events[1].synchronize()
            device_s = queued.events[0].elapsed_time(queued.events[1]) / 1e3
        self._queued.pop(0)
        new_rows = queued.host_rows.numpy()
        now = time.perf_counter()
        elapsed = now - max(queued.started_s, self._last_finish_s)
        self._last_finish_s = now
        self.device_busy_s += device_s
        for release in queued.deferred:
            release()
        for s, row in zip(queued.streams, new_rows, strict=True):
            if s.status is not StreamStatus.RUNNING:  # ended meanwhile: its row was speculative
                continue
            s.generated.append(row)
            self._after_rows(s)
        self.metrics.observe("tandem_step_seconds", elapsed)
        return FinishedStep(len(queued.streams), queued.context, elapsed, device_s)

    def fail_all(self, reason: str) -> None:
        """Every stream fails and leaves (pages released), even if one client's sink raises. A queued
        step is waited for first (it may still write its streams' pages) and its rows dropped."""
        if self._queued and self.pool.device.type == "cuda":
            try:
                torch.cuda.current_stream(self.pool.device).synchronize()
            except Exception:  # a broken device: nothing of ours can still write either
                log.exception("waiting for the queued decode step failed")
        queued, self._queued = self._queued, []
        for q in queued:
            for release in q.deferred:
                release()
        for s in list(self.streams):
            s.status = StreamStatus.FAILED
            try:
                s.sink.fail(StreamFailed(reason))
            except Exception:
                log.exception("could not tell stream %d that it failed", s.stream_id)
            finally:
                self._leave(s)

    def _after_rows(self, s: Stream) -> None:
        """Emit the rows pending since the last chunk once they fill the size chosen when it left (or
        the stream is done), then choose the next chunk's size from the listener's lead now."""
        last = s.generated[-1]
        done = len(s.generated) >= s.max_new_rows or self.rows.ends(last, s.sampling, s.eos_token_id)
        pending = len(s.generated) - s.emitted_rows
        if not done and pending < s.chunk_rows:
            return
        rows = np.stack(s.generated[s.emitted_rows :])
        now = self._clock()
        if id(s) not in self._first_emit_s:
            self._first_emit_s[id(s)] = now
            self._first_rows[id(s)] = len(s.generated)
        if s.chunk_index == 0:
            s.timings.mark("first_chunk")
        if done:
            s.timings.mark("last_chunk")
        assert s.frames is not None
        s.frames.push(rows)  # the codec frames these rows complete, and the context they need
        sent = s.frames.emitted
        window = s.frames.window(final=done)
        # a real-time listener starts playing with the first sounding chunk (and resumes after a stall)
        s.playing_since_s = self.chunking.playing_since(sent, s.frames.emitted, s.playing_since_s, now)
        chunk = Chunk(rows=rows, first_row=s.emitted_rows, final=done, timings=s.timings, window=window)
        s.emitted_rows = len(s.generated)
        s.chunk_index += 1
        lead = self.chunking.lead_s(s.frames.emitted, s.playing_since_s, now)
        s.chunk_rows = self.chunking.next_rows(s.chunk_index, lead)
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
        """`s` leaves the batch; its release runs now, or when the last queued step that computes a
        row for it has finished (that step writes the stream's KV)."""
        self.streams.remove(s)
        self._first_emit_s.pop(id(s), None)
        self._first_rows.pop(id(s), None)
        release = self._releases.pop(id(s))
        holder = next((q for q in reversed(self._queued) if id(s) in q.members), None)
        if holder is None:
            release()
        else:
            holder.deferred.append(release)
