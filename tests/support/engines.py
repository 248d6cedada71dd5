"""The engines driven without Triton: recording sinks, test settings, a started P+D pair in this
process, a prefilled handoff, and `Job`, one stream prefilled into a pool for a `DecodeBatch`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
import torch

from tandem.backend.engines.batch import DecodeBatch
from tandem.backend.engines.decode.engine import DecodeEngine
from tandem.backend.engines.handoff import Handoff
from tandem.backend.engines.parts import make_batch, make_pool
from tandem.backend.engines.prefill import PrefillEngine, PrefillRequest
from tandem.backend.engines.stream import Chunk, Stream
from tandem.backend.errors import TandemError
from tandem.backend.generation.sampling import SamplingParams, sample
from tandem.backend.kv.pool import KVPool
from tandem.backend.metrics import RecordingMetrics
from tandem.backend.model.decoder import Decoder
from tandem.backend.settings import BatchSettings, EngineSettings, PoolSettings, TransferSettings
from tandem.backend.timing import Timings


class ListSink:
    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.error: TandemError | None = None
        self.done = threading.Event()
        self.cancel = False

    def emit(self, chunk: Chunk) -> None:
        self.chunks.append(chunk)
        if chunk.final:
            self.done.set()

    def fail(self, error: TandemError) -> None:
        self.error = error
        self.done.set()

    def cancelled(self) -> bool:
        return self.cancel

    def rows(self) -> np.ndarray:
        return np.concatenate([c.rows for c in self.chunks])


class HandoffBox:
    def __init__(self) -> None:
        self.handoff: Handoff | None = None
        self.error: TandemError | None = None
        self.done = threading.Event()

    def send(self, handoff: Handoff) -> None:
        self.handoff = handoff
        self.done.set()

    def fail(self, error: TandemError) -> None:
        self.error = error
        self.done.set()

    def cancelled(self) -> bool:
        return False


def engine_settings(tmp_path, **batch) -> EngineSettings:
    return EngineSettings(
        pool=PoolSettings(num_pages=512, page_size=16),
        batch=replace(BatchSettings(admission_timeout_s=1.0), **batch),
        transfer=TransferSettings(unit="t" + str(abs(hash(str(tmp_path))) % 10**8), arena_mb=16),
    )


def prompt_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, size=(n, 4), dtype=np.int64)


@contextmanager
def started_pd(decoder: Decoder, s: EngineSettings) -> Iterator[tuple[PrefillEngine, DecodeEngine]]:
    """A started P and D in this process with settings `s`, closed (D first) when the block ends."""
    p = PrefillEngine(decoder, s, RecordingMetrics(), "p0", on_fatal=lambda r: pytest.fail(r))
    d = DecodeEngine(decoder, s, RecordingMetrics())
    p.start()
    d.start()
    try:
        yield p, d
    finally:
        d.close()
        p.close()


def prefill_handoff(p: PrefillEngine, stream_id: int, max_new_rows: int) -> Handoff:
    """Prefill a 30-row prompt on `p` and return its handoff (what the ensemble would pass to D)."""
    box = HandoffBox()
    prompt = prompt_rows(30, stream_id)
    p.submit(PrefillRequest(stream_id, prompt, SamplingParams(), max_new_rows, box, Timings()))
    assert box.done.wait(10) and box.error is None and box.handoff is not None
    return box.handoff


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not cond():
        time.sleep(0.02)
    return cond()


def decode_batch(
    dec: Decoder, clock: Callable[[], float] = time.perf_counter, **batch: object
) -> tuple[DecodeBatch, KVPool]:
    """A running batch on a small pool; `clock` times its chunks (a fixed one makes chunk sizes, which
    follow the listener's lead, depend on rows alone)."""
    s = EngineSettings(pool=PoolSettings(num_pages=256, page_size=16), batch=BatchSettings(**batch))  # type: ignore[arg-type]
    pool = make_pool(dec, s)
    return make_batch(dec, pool, s, RecordingMetrics(), clock), pool


class Job:
    """One stream to run: its prompt is prefilled into the pool when it is made."""

    def __init__(self, dec: Decoder, pool: KVPool, i: int, n: int, eos: int | None = None) -> None:
        x = np.random.default_rng(i).integers(0, dec.cfg.vocab_size, size=(7 + 5 * i, dec.cfg.row_width))
        self.pages = pool.allocate(pool.pages_for(len(x) + n))
        slots = pool.slots(self.pages, len(x) + n)
        logits = dec.prefill(torch.from_numpy(x).to(pool.device), pool, slots[: len(x)], 0)
        sp = SamplingParams(temperature=0.9 * (i % 2), seed=i)
        self.sink = ListSink()
        self.stream = Stream(
            i, len(x), sp, n, self.sink, Timings(), eos_token_id=eos, pages=self.pages, slots=slots
        )
        self.first = sample(logits[None], [sp], [len(x)])[0].numpy()
        self.released = 0
        self.pool = pool

    def release(self) -> None:
        self.released += 1
        self.pool.free(self.pages)

    def add_to(self, batch: DecodeBatch) -> None:
        batch.add(self.stream, self.first, self.release)
