"""Graph replay of the decode step equals the eager step (GPU only; skipped honestly on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return torch.device("cuda", 0)


@pytest.mark.parametrize("batches", [[1, 3, 8], [5, 2, 16, 9]])
def test_graphed_decode_matches_eager(cuda, batches):
    from tandem.backend.model.cuda_graphs import GraphedDecode

    dec = Decoder.random(preset("tiny"), cuda, seed=1)
    pool = KVPool(dec.kv_layout(), 512, 16, cuda)
    graphed = GraphedDecode(dec, pool, max_batch=16, context_step=64)
    gen = torch.Generator(device=cuda).manual_seed(0)
    for layer in range(pool.kv.shape[0]):
        pool.kv[layer].normal_(generator=gen)
    for b in batches:
        ctx = torch.randint(1, 150, (b,))
        pages = [pool.allocate(pool.pages_for(int(c) + 1)) for c in ctx]
        tables = [pool.slots(p, int(c) + 1) for p, c in zip(pages, ctx, strict=True)]
        rows = torch.randint(0, 1024, (b, 4))
        before = pool.kv.clone()
        eager = dec.decode(rows, pool, tables, ctx)
        after_eager = pool.kv.clone()
        pool.kv.copy_(before)
        got = graphed.decode(rows, tables, ctx)
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
        # Same KV writes; padding rows of the graph touch only its own scratch page.
        scratch = slice(graphed._scratch_slot, graphed._scratch_slot + pool.page_size)
        pool.kv[:, :, scratch] = after_eager[:, :, scratch]
        torch.testing.assert_close(pool.kv, after_eager)
        for p in pages:
            pool.free(p)


def test_a_batch_above_the_last_power_of_two_replays_the_max_batch_graph(cuda):
    """max_batch 12: batches 9-12 replay one graph of 12 rows (not the eager step, which is ~10x
    slower on a GPU), and equal the eager step."""
    from tandem.backend.model.cuda_graphs import GraphedDecode

    dec = Decoder.random(preset("tiny"), cuda, seed=1)
    pool = KVPool(dec.kv_layout(), 256, 16, cuda)
    graphed = GraphedDecode(dec, pool, max_batch=12, context_step=64)
    for b in (10, 12):
        ctx = torch.randint(1, 100, (b,))
        tables = [pool.slots(pool.allocate(pool.pages_for(int(c) + 1)), int(c) + 1) for c in ctx]
        rows = torch.randint(0, 1024, (b, 4))
        before = pool.kv.clone()
        eager = dec.decode(rows, pool, tables, ctx)
        pool.kv.copy_(before)
        torch.testing.assert_close(graphed.decode(rows, tables, ctx), eager, rtol=1e-4, atol=1e-4)
    assert {bb for bb, _ in graphed._graphs} == {12} and graphed.failed is None
    graphed.warm_up(64)
    assert {bb for bb, s in graphed._graphs if s == 64} == {1, 2, 4, 8, 12}


def test_warm_up_captures_every_bucket(cuda):
    from tandem.backend.model.cuda_graphs import GraphedDecode

    dec = Decoder.random(preset("tiny"), cuda, seed=1)
    pool = KVPool(dec.kv_layout(), 64, 16, cuda)
    graphed = GraphedDecode(dec, pool, max_batch=8, context_step=64)
    assert graphed.warm_up(256) == 4 * 4  # batch buckets 1, 2, 4, 8 x contexts 64..256


def test_capture_while_another_thread_synchronises(cuda):
    """D captures lazily while its admission and checksum threads keep using CUDA on their own streams
    (a 2xH200 fault-matrix run failed every capture with the default global capture mode)."""
    import threading

    from tandem.backend.model.cuda_graphs import GraphedDecode

    dec = Decoder.random(preset("tiny"), cuda, seed=1)
    pool = KVPool(dec.kv_layout(), 64, 16, cuda)
    graphed = GraphedDecode(dec, pool, max_batch=8, context_step=64)
    stop = threading.Event()

    def busy() -> None:
        side = torch.cuda.Stream(device=cuda)
        x = torch.ones(1 << 20, device=cuda)
        with torch.cuda.stream(side):
            while not stop.is_set():
                (x * 2).sum().item()  # a synchronising call, like the receiver's checksum

    t = threading.Thread(target=busy)
    t.start()
    try:
        assert graphed.warm_up(256) == 16
    finally:
        stop.set()
        t.join()
    assert graphed.failed is None


def test_failed_capture_falls_back_to_eager(cuda, monkeypatch):
    from tandem.backend.model.cuda_graphs import GraphedDecode

    dec = Decoder.random(preset("tiny"), cuda, seed=1)
    pool = KVPool(dec.kv_layout(), 64, 16, cuda)
    graphed = GraphedDecode(dec, pool, max_batch=8, context_step=64)

    def broken(bb: int, s: int) -> None:
        raise RuntimeError("capture refused")

    monkeypatch.setattr(graphed, "_capture", broken)
    pages = pool.allocate(2)
    tables = [pool.slots(pages, 20)]
    rows = torch.randint(0, 1024, (1, 4))
    before = pool.kv.clone()
    got = graphed.decode(rows, tables, torch.tensor([19]))
    assert graphed.failed == "RuntimeError: capture refused"
    pool.kv.copy_(before)
    torch.testing.assert_close(got, dec.decode(rows, pool, tables, torch.tensor([19])))
