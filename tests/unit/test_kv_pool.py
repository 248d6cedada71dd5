"""KVPool: page accounting (no leaks, no partial allocation, double-free detection) and slot addressing."""

from __future__ import annotations

import pytest
import torch

from tandem.backend.errors import PoolExhausted
from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.backend.model.config import PRESETS

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)


def test_layout_sizes() -> None:
    assert LAYOUT.token_bytes == 2 * 2 * 2 * 4 * 4
    assert LAYOUT.staging_shape(7) == (2, 2, 7, 2, 4)
    tiny = PRESETS["tiny"]
    assert tiny.kv_layout().token_bytes == tiny.kv_bytes_per_token
    assert PRESETS["qwen3-4b-shape"].kv_layout().token_bytes == 144 * 1024


def test_allocate_free_no_leak() -> None:
    pool = KVPool(LAYOUT, num_pages=10, page_size=4, device="cpu")
    assert pool.kv.shape == (2, 2, 40, 2, 4)
    assert pool.num_free_pages == 10
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8
    assert pool.num_free_pages == 2
    pool.free(a)
    pool.free(b)
    assert pool.num_free_pages == 10
    assert sorted(pool.allocate(10)) == list(range(10))
    assert pool.pages_for(0) == 0 and pool.pages_for(4) == 1 and pool.pages_for(5) == 2


def test_exhausted_allocates_nothing() -> None:
    pool = KVPool(LAYOUT, num_pages=4, page_size=2, device="cpu")
    held = pool.allocate(3)
    with pytest.raises(PoolExhausted):
        pool.allocate(2)
    assert pool.num_free_pages == 1
    pool.free(held)
    assert pool.num_free_pages == 4


def test_double_free_and_range_errors() -> None:
    pool = KVPool(LAYOUT, num_pages=4, page_size=2, device="cpu")
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError):
        pool.free(pages[:1])
    with pytest.raises(ValueError):
        pool.free([pages[1], pages[1]])  # repeated within one call
    with pytest.raises(ValueError):
        pool.free([99])
    # The failed calls freed nothing.
    assert pool.num_free_pages == 3
    pool.free(pages[1:])
    assert pool.num_free_pages == 4


def test_fragmented_allocation_and_slots() -> None:
    pool = KVPool(LAYOUT, num_pages=8, page_size=4, device="cpu")
    pages = pool.allocate(8)
    assert pages == list(range(8))
    pool.free(pages[1::2])
    frag = pool.allocate(3)
    assert frag == [1, 3, 5]  # most recently freed first, in the order they were freed
    slots = pool.slots(frag, 10)
    assert slots.dtype == torch.long
    assert slots.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21]
    with pytest.raises(ValueError):
        pool.slots(frag, 13)


def test_gather_scatter_round_trip_on_fragmented_pages() -> None:
    pool = KVPool(LAYOUT, num_pages=8, page_size=4, device="cpu")
    pool.free(pool.allocate(8)[::2])
    frag = pool.allocate(3)
    slots = pool.slots(frag, 11)
    src = torch.randn(LAYOUT.staging_shape(11))
    pool.scatter(slots, src)
    out = torch.empty(LAYOUT.staging_shape(11))
    pool.gather(slots, out)
    torch.testing.assert_close(out, src, rtol=0, atol=0)
    # Exactly those slots were written; everything else is still zero.
    untouched = torch.ones(pool.kv.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert pool.kv[:, :, untouched].abs().sum() == 0
    # Slot 4*frag[0]+1 holds token 1.
    torch.testing.assert_close(pool.kv[:, :, frag[0] * 4 + 1], src[:, :, 1])


def test_gather_scatter_run_kv_cuda_without_a_bounds_sync(monkeypatch) -> None:
    """The pool's hand-off copies go through the kv_cuda entry points (kernels on a GPU) with
    check_bounds=False: a bounds check is a device sync, and D's loop scatters while a step runs."""
    from tandem.csrc import kv_cuda

    calls: list[tuple[str, bool]] = []
    gather, scatter = kv_cuda.gather, kv_cuda.scatter

    def spy_gather(pool, slots, out, *, check_bounds=True):
        calls.append(("gather", check_bounds))
        gather(pool, slots, out, check_bounds=check_bounds)

    def spy_scatter(staging, pool, slots, *, check_bounds=True):
        calls.append(("scatter", check_bounds))
        scatter(staging, pool, slots, check_bounds=check_bounds)

    monkeypatch.setattr(kv_cuda, "gather", spy_gather)
    monkeypatch.setattr(kv_cuda, "scatter", spy_scatter)
    pool = KVPool(LAYOUT, num_pages=4, page_size=4, device="cpu")
    slots = pool.slots(pool.allocate(2), 6)
    src = torch.randn(LAYOUT.staging_shape(6))
    pool.scatter(slots, src)
    out = torch.empty(LAYOUT.staging_shape(6))
    pool.gather(slots, out)
    assert torch.equal(out, src)
    assert calls == [("scatter", False), ("gather", False)]


def test_gather_scatter_check_shapes_and_copy_nothing_for_no_tokens() -> None:
    pool = KVPool(LAYOUT, num_pages=4, page_size=4, device="cpu")
    slots = pool.slots(pool.allocate(2), 6)
    with pytest.raises(ValueError, match="staging has shape"):
        pool.gather(slots, torch.empty(LAYOUT.staging_shape(5)))  # index_select would have resized it
    with pytest.raises(ValueError, match="staging has shape"):
        pool.scatter(slots, torch.empty(LAYOUT.staging_shape(7)))
    with pytest.raises(TypeError):
        pool.scatter(slots, torch.empty(LAYOUT.staging_shape(6), dtype=torch.float16))
    with pytest.raises(TypeError):
        pool.gather(slots.int(), torch.empty(LAYOUT.staging_shape(6)))
    none = slots[:0]
    pool.scatter(none, torch.empty(LAYOUT.staging_shape(0)))
    pool.gather(none, torch.empty(LAYOUT.staging_shape(0)))
    assert pool.kv.abs().sum() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_gather_scatter_match_the_reference_bit_for_bit(dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    from tandem.csrc import kv_cuda

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, dtype=dtype)
    pool = KVPool(layout, num_pages=64, page_size=1, device="cuda")
    g = torch.Generator().manual_seed(0)
    pages = pool.allocate(64)
    pool.free([pages[i] for i in torch.randperm(64, generator=g)[:40].tolist()])  # fragment the free list
    slots = pool.slots(pool.allocate(37), 37)
    src = torch.randn(layout.staging_shape(37), generator=g).to("cuda", dtype)
    ref = pool.kv.clone()
    pool.scatter(slots, src)
    kv_cuda.reference_scatter(src, ref, slots)
    assert torch.equal(pool.kv.view(torch.uint8), ref.view(torch.uint8))
    out = torch.full(layout.staging_shape(37), float("nan"), dtype=dtype, device="cuda")
    pool.gather(slots, out)
    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8))
