"""Times D's real decode loop at start-up, to seed the step-time model before the first admission.

Rate-floor admission (`backend/scheduling/step_model.py`) predicts the step time with a newcomer; a
fresh D that learned only from live steps extrapolates from a few small batches when the first burst
arrives (docs/benchmarks). So before admitting, D runs its own loop (`DecodeBatch.advance()`, graph
replay, sampling, chunks to a sink that drops them) over synthetic streams in its own pool at a few
batch sizes and contexts; each timed step is a permanent sample (`StepTimeModel.seed`).

Called once by the engine that owns the batch and pool, before any stream exists; every page comes
back, zeroed, afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.backend.engines.batch import DecodeBatch, FinishedStep
from tandem.backend.engines.stream import Chunk, ChunkSink, Stream
from tandem.backend.errors import TandemError
from tandem.backend.generation.grammar import Grammar
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.timing import Timings

WARMUP_STEPS = 2  # the first steps of each point: the pipeline filling, first use of a graph bucket


@dataclass(frozen=True)
class Point:
    batch: int
    context: int  # tokens of KV per stream when its first timed step runs


class _DropSink:
    """Takes chunks and drops them: the calibration's streams have no client."""

    def emit(self, chunk: Chunk) -> None:
        pass

    def fail(self, error: TandemError) -> None:
        pass  # only after a step raised; time_steps re-raises that

    def cancelled(self) -> bool:
        return False


def rows_per_stream(steps: int) -> int:
    """Rows each calibration stream generates for `steps` timed steps: row 0 stands for P's, then one
    step per row: WARMUP_STEPS untimed, `steps` timed, and a last one finished by `drain()` (its period
    is not the loop's, so it is not timed either)."""
    return WARMUP_STEPS + steps + 2


def add_stream(
    batch: DecodeBatch,
    stream_id: int,
    seed: int,
    context: int,
    rows: int,
    sink: ChunkSink,
    rng: np.random.Generator,
    grammar: Grammar = Grammar.NONE,
) -> None:
    """Adds a synthetic stream to `batch`: `context` tokens of prompt already in its pages (whatever
    the pool holds there), `rows` rows to generate with temperature 0.8 / top-p 0.95 under `grammar`
    from a random first row; its pages go back to the pool when it leaves. Also used by
    tandem-bench-decode-loop."""
    pool, dec = batch.pool, batch.decoder
    pages = pool.allocate(pool.pages_for(context + rows))
    stream = Stream(
        stream_id=stream_id,
        prompt_len=context,
        sampling=SamplingParams(
            temperature=0.8, top_p=0.95, seed=seed, grammar=grammar, grammar_start=context
        ),
        max_new_rows=rows,
        sink=sink,
        timings=Timings(),
        pages=pages,
        slots=pool.slots(pages, context + rows),
    )
    first = rng.integers(0, dec.cfg.vocab_size, size=dec.cfg.row_width, dtype=np.int64)
    batch.add(stream, first, lambda: pool.free(pages))


def points(max_batch: int, max_context: int, pool_tokens: int, steps: int, page_size: int) -> list[Point]:
    """Batch sizes 1, max/4, max/2 and max, each at a short and a long context (max_context / 8 and
    max_context), each shortened to what the pool holds for that many streams. The model is linear
    in (batch, total context), so spread points are what its fit needs."""
    out: list[Point] = []
    for b in sorted({1, max(1, max_batch // 4), max(1, max_batch // 2), max_batch}):
        per_stream = pool_tokens // b - rows_per_stream(steps) - page_size  # + a page of rounding
        for c in sorted({max(1, max_context // 8), max_context}):
            c = min(c, per_stream)
            if c >= 1 and Point(b, c) not in out:
                out.append(Point(b, c))
    return out


def time_steps(
    batch: DecodeBatch, plan: list[Point], steps: int, seed: int = 0, grammar: Grammar = Grammar.NONE
) -> list[FinishedStep]:
    """Runs every point of `plan` through `batch` (which must be empty): `steps` timed steps each after
    WARMUP_STEPS untimed ones; returns the timed steps. Every page taken comes back. The streams
    sample under `grammar`, the one D's streams sample under (a grammar's step computes fewer of the
    head's rows and samples over fewer ids: timing it without would overstate every step)."""
    if len(batch):
        raise RuntimeError("calibration needs an empty batch")
    pool = batch.pool
    pool.randomize(torch.Generator(device=pool.device).manual_seed(seed))  # never time on zeros
    rng = np.random.default_rng(seed)
    timed: list[FinishedStep] = []
    # The calibration's steps and streams are not the service's: keep them out of its metrics.
    live_metrics, busy_s = batch.metrics, batch.device_busy_s
    batch.metrics = RecordingMetrics()
    rows = rows_per_stream(steps)
    try:
        for pt in plan:
            for i in range(pt.batch):
                add_stream(batch, -(i + 1), i, pt.context, rows, _DropSink(), rng, grammar)
            finished = []
            while len(batch):
                done = batch.advance()
                if done is not None:
                    finished.append(done)
            batch.drain()
            timed.extend(finished[WARMUP_STEPS : WARMUP_STEPS + steps])
    finally:
        batch.fail_all("calibration ended")  # only if a step raised: every stream leaves, pages back
        batch.metrics, batch.device_busy_s = live_metrics, busy_s
        pool.kv.zero_()
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)
    return timed
