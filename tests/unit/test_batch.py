"""The running batch's pipelined loop (`backend/engines/batch.py`): `advance()` queues step n+1 from step n's
rows on the device before it waits for step n. These check that it produces exactly the serial
loop's tokens and chunks, that a stream's pages come back only once no queued step can still write
them, and what a stream joining, cancelling or failing between two `advance()` calls gets."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from tandem.backend.errors import Cancelled, StreamFailed
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder
from tests.support.engines import Job, decode_batch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _decoder(device: str) -> Decoder:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return Decoder.random(preset("tiny"), device, seed=0)


def _run(
    dec: Decoder, make: Callable[[KVPool], list[Job]], pipelined: bool, join_after: int = 2
) -> list[Job]:
    """Runs jobs[0..1] from the start and the rest after `join_after` loop turns, to the end. The
    chunk clock stands still, so chunk sizes (which follow the listener's lead) depend on rows only
    and the serial and pipelined loops can be compared chunk by chunk."""
    batch, pool = decode_batch(dec, clock=lambda: 0.0)
    free = pool.num_free_pages
    jobs = make(pool)
    for j in jobs[:2]:
        j.add_to(batch)
    turns = 0
    while len(batch) or turns <= join_after:
        if turns == join_after:
            for j in jobs[2:]:
                j.add_to(batch)
        if pipelined:
            batch.advance()
        else:
            batch.step()
        turns += 1
    batch.drain()
    assert not batch.in_flight
    assert pool.num_free_pages == free, "every page came back"
    assert [j.released for j in jobs] == [1] * len(jobs), "each release ran exactly once"
    return jobs


@pytest.mark.parametrize("device", DEVICES)
def test_pipelined_loop_gives_the_serial_loops_tokens_and_chunks(device):
    """Greedy and sampled streams of different lengths, two joining while a step is queued, and an
    EOS that ends streams at a row nobody knew in advance: the same rows, in the same chunks."""
    dec = _decoder(device)
    plain = _run(dec, lambda pool: [Job(dec, pool, i, 6 + 3 * i) for i in range(4)], pipelined=False)
    eos = int(plain[1].sink.rows()[4][0])  # a token stream 1 is known to produce: it ends there
    for e in (None, eos):
        serial = _run(dec, lambda pool, e=e: [Job(dec, pool, i, 6 + 3 * i, e) for i in range(4)], False)
        piped = _run(dec, lambda pool, e=e: [Job(dec, pool, i, 6 + 3 * i, e) for i in range(4)], True)
        for a, b in zip(serial, piped, strict=True):
            assert a.sink.error is None and b.sink.error is None
            assert [c.first_row for c in a.sink.chunks] == [c.first_row for c in b.sink.chunks]
            np.testing.assert_array_equal(a.sink.rows(), b.sink.rows())
            assert b.sink.chunks[-1].final
    assert len(piped[1].sink.rows()) < piped[1].stream.max_new_rows  # the EOS run really ended early


def test_a_stream_that_ends_gets_its_pages_back_after_the_step_still_writing_them():
    """The step queued behind the one that produced a stream's EOS writes that row's KV into the
    stream's pages: the KV there really changes, and the release waits until that step finished."""
    dec = _decoder("cpu")
    batch, pool = decode_batch(dec)
    probe = Job(dec, pool, 0, 12)
    probe.add_to(batch)
    while len(batch):
        batch.step()
    eos = int(probe.sink.rows()[3][0])
    job = Job(dec, pool, 0, 12, eos)  # same prompt and seed: it ends at the same row
    other = Job(dec, pool, 1, 30)
    job.add_to(batch)
    other.add_to(batch)
    while True:
        before = pool.kv.clone()  # the CPU runs a queued step's forward inside advance()
        batch.advance()
        if job.sink.chunks and job.sink.chunks[-1].final:
            break
    ended_at = len(job.sink.rows())
    assert ended_at < job.stream.max_new_rows
    assert job.released == 0 and batch.in_flight  # the queued step still has a row for it
    slot = int(job.stream.slots[job.stream.prompt_len + ended_at - 1])
    assert not torch.equal(pool.kv[:, :, slot], before[:, :, slot])  # the EOS row's KV, written by it
    batch.advance()  # finishes that step, then the pages come back
    assert job.released == 1
    while len(batch):
        batch.advance()
    batch.drain()
    assert other.released == 1 and other.sink.error is None


def test_a_stream_at_max_rows_is_never_queued_past_them():
    """max_new_rows is known in advance: no step is queued for a row the stream will not take, so its
    pages come back with its final chunk, and a first row that is the last frees them at once."""
    dec = _decoder("cpu")
    batch, pool = decode_batch(dec)
    job = Job(dec, pool, 2, 3)
    job.add_to(batch)
    while not job.sink.done.is_set():
        batch.advance()
    assert job.released == 1 and not batch.in_flight
    single = Job(dec, pool, 3, 1)  # P's row 0 is its only row
    single.add_to(batch)
    assert single.released == 1 and single.sink.chunks[-1].final and len(batch) == 0


def test_streams_joining_between_advances_miss_the_queued_step_only():
    """A stream added while a step is queued joins the next one; until then its position stays at
    its prompt, and it gets exactly the rows a serial loop gives it."""
    dec = _decoder("cpu")
    batch, pool = decode_batch(dec)
    a, b = Job(dec, pool, 0, 8), Job(dec, pool, 1, 8)
    a.add_to(batch)
    assert batch.advance() is None and batch.in_flight  # queued, nothing finished yet
    b.add_to(batch)
    finished = batch.advance()  # queues the step with both, finishes the one with a only
    assert finished is not None and finished.batch == 1
    assert len(b.stream.generated) == 1  # b's first decode row is in the queued step
    while len(batch):
        batch.advance()
    batch.drain()
    serial = _run(dec, lambda pool: [Job(dec, pool, 0, 8), Job(dec, pool, 1, 8)], False)
    np.testing.assert_array_equal(serial[1].sink.rows(), b.sink.rows())
    assert a.released == b.released == 1


def test_cancel_and_fail_all_with_a_step_queued_release_each_stream_once():
    dec = _decoder("cpu")
    batch, pool = decode_batch(dec)
    free = pool.num_free_pages
    jobs = [Job(dec, pool, i, 40) for i in range(3)]
    for j in jobs:
        j.add_to(batch)
    for _ in range(3):
        batch.advance()
    jobs[0].sink.cancel = True
    while jobs[0].sink.error is None:  # the cancel sweep runs every few steps
        batch.advance()
    assert isinstance(jobs[0].sink.error, Cancelled)
    rows_then = len(jobs[0].sink.chunks)
    batch.advance()
    assert jobs[0].released == 1 and len(jobs[0].sink.chunks) == rows_then  # no rows after its end
    assert batch.in_flight
    batch.fail_all("engine fault")
    assert not batch.in_flight and len(batch) == 0
    for j in jobs[1:]:
        assert isinstance(j.sink.error, StreamFailed) and j.released == 1
    assert pool.num_free_pages == free
    assert batch.advance() is None and batch.drain() is None  # an empty batch does nothing


def test_graph_batch_buckets_end_at_max_batch():
    from tandem.backend.model.cuda_graphs import batch_bucket, batch_buckets

    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(96) == [1, 2, 4, 8, 16, 32, 64, 96]
    assert batch_buckets(1) == [1]
    assert [batch_bucket(b, 96) for b in (1, 3, 64, 65, 96)] == [1, 4, 64, 96, 96]
