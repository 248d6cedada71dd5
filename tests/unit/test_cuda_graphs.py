"""Graph replay of the decode step equals the eager step (GPU only; skipped honestly on the CPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.backend.config import preset
from tandem.backend.decoder import Decoder
from tandem.backend.kv_pool import KVPool

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return torch.device("cuda", 0)


@pytest.mark.parametrize("batches", [[1, 3, 8], [5, 2, 16, 9]])
def test_graphed_decode_matches_eager(cuda, batches):
    from tandem.backend.cuda_graphs import GraphedDecode

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


def test_warm_up_captures_every_bucket(cuda):
    from tandem.backend.cuda_graphs import GraphedDecode

    dec = Decoder.random(preset("tiny"), cuda, seed=1)
    pool = KVPool(dec.kv_layout(), 64, 16, cuda)
    graphed = GraphedDecode(dec, pool, max_batch=8, context_step=64)
    assert graphed.warm_up(256) == 4 * 4  # batch buckets 1, 2, 4, 8 x contexts 64..256
