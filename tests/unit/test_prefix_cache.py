"""PrefixCache: sharing, the never-whole-prompt rule, refcounts, LRU eviction and page accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.backend.errors import PoolExhausted
from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.backend.kv.prefix_cache import PrefixCache

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
PAGE = 4


def make(num_pages: int = 16, enabled: bool = True) -> tuple[KVPool, PrefixCache]:
    pool = KVPool(LAYOUT, num_pages=num_pages, page_size=PAGE, device="cpu")
    return pool, PrefixCache(pool, enabled=enabled)


def prompt(n: int, seed: int, width: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=(n, width), dtype=np.int64)


def test_miss_then_hit_on_shared_prefix() -> None:
    pool, cache = make()
    a_rows = prompt(10, 0)
    a = cache.allocate(a_rows, extra_tokens=6)
    assert a.cached_tokens == 0 and a.n_tokens == 16 and len(a.pages) == 4
    cache.commit(a, a_rows)
    assert cache.stats["cached_pages"] == 2  # only the 2 full prompt pages
    b_rows = np.concatenate([a_rows[:9], prompt(5, 1)])  # shares 9 rows -> 2 full pages
    b = cache.allocate(torch.from_numpy(b_rows))
    assert b.cached_tokens == 8
    assert b.pages[:2] == a.pages[:2]
    assert not set(b.pages[2:]) & set(a.pages)
    assert cache.stats["hit_tokens"] == 8 and cache.stats["miss_tokens"] == 10 + 6
    cache.release(a)
    cache.release(b)
    assert pool.num_free_pages + cache.stats["evictable_pages"] == 16


def test_never_whole_prompt() -> None:
    _, cache = make()
    rows = prompt(8, 2)  # exactly two full pages
    a = cache.allocate(rows)
    cache.commit(a, rows)
    again = cache.allocate(rows)
    assert again.cached_tokens == 4  # last page is recomputed so the caller gets last-token logits
    assert again.pages[0] == a.pages[0] and again.pages[1] != a.pages[1]
    longer = cache.allocate(np.concatenate([rows, prompt(1, 3)]))
    assert longer.cached_tokens == 8
    short = cache.allocate(rows[:4])
    assert short.cached_tokens == 0


def test_different_width_or_content_misses() -> None:
    _, cache = make()
    rows = prompt(9, 4)
    a = cache.allocate(rows)
    cache.commit(a, rows)
    changed = rows.copy()
    changed[0, 1] += 1  # first page differs -> chain differs for every later page too
    assert cache.allocate(changed).cached_tokens == 0
    assert cache.allocate(rows.reshape(-1, 1)[:9]).cached_tokens == 0


def test_refcounts_keep_pages_until_last_release() -> None:
    pool, cache = make()
    rows = prompt(9, 5)
    a = cache.allocate(rows)
    cache.commit(a, rows)
    b = cache.allocate(rows)
    c = cache.allocate(rows)
    shared = a.pages[:2]
    assert b.pages[:2] == shared and c.pages[:2] == shared
    cache.release(a)
    cache.release(b)
    assert cache.stats["evictable_pages"] == 0  # c still holds the shared pages
    cache.release(c)
    assert cache.stats["evictable_pages"] == 2
    assert pool.num_free_pages == 14
    with pytest.raises(ValueError):
        cache.release(c)
    d = cache.allocate(rows)  # a cached page with refcount 0 is reused, not re-computed
    assert d.pages[:2] == shared and cache.stats["evictable_pages"] == 0


def test_eviction_under_pressure_and_exhaustion() -> None:
    pool, cache = make(num_pages=6)
    rows = prompt(17, 6)  # 4 full pages + 1 token
    a = cache.allocate(rows)
    assert len(a.pages) == 5
    cache.commit(a, rows)
    cache.release(a)
    assert pool.num_free_pages == 2 and cache.stats["evictable_pages"] == 4
    # Needs 3 pages: one cached page must go, and it must be the deepest (a leaf), not the root.
    other = cache.allocate(prompt(12, 7))
    assert cache.stats["evictions"] == 1
    cache.release(other)
    again = cache.allocate(rows)
    assert again.cached_tokens == 12  # pages 0..2 of the chain survive
    cache.release(again)
    with pytest.raises(PoolExhausted):
        cache.allocate(prompt(40, 8))
    assert cache.stats["evictions"] == 1  # a failed allocation evicts nothing


def test_exhaustion_leaks_nothing_and_keeps_matched_pages() -> None:
    pool, cache = make(num_pages=4)
    rows = prompt(9, 9)
    a = cache.allocate(rows)
    cache.commit(a, rows)
    cache.release(a)
    before = (pool.num_free_pages, dict(cache.stats))
    with pytest.raises(PoolExhausted):
        cache.allocate(rows, extra_tokens=100)
    assert (pool.num_free_pages, cache.stats) == before
    assert cache.allocate(rows).cached_tokens == 8


def test_all_pages_return_after_release() -> None:
    pool, cache = make(num_pages=32)
    allocs = []
    base = prompt(20, 10)
    for i in range(6):
        rows = np.concatenate([base[: 4 * i + 3], prompt(6, 20 + i)])
        alloc = cache.allocate(rows, extra_tokens=3)
        cache.commit(alloc, rows)
        allocs.append(alloc)
    for alloc in allocs:
        cache.release(alloc)
    assert pool.num_free_pages + cache.stats["evictable_pages"] == 32
    assert cache.available_pages == 32
    # Pressure evicts every cached page; the whole pool can be handed out again.
    everything = cache.allocate(prompt(32 * PAGE, 99))
    assert len(everything.pages) == 32 and pool.num_free_pages == 0
    cache.release(everything)
    assert pool.num_free_pages == 32


def test_disabled_cache_never_hits() -> None:
    pool, cache = make(enabled=False)
    rows = prompt(9, 11)
    a = cache.allocate(rows)
    cache.commit(a, rows)
    b = cache.allocate(rows)
    assert b.cached_tokens == 0 and cache.stats["cached_pages"] == 0
    cache.release(a)
    cache.release(b)
    assert pool.num_free_pages == 16


def test_duplicate_commit_keeps_second_copy_private() -> None:
    pool, cache = make()
    rows = prompt(9, 12)
    a = cache.allocate(rows)
    b = cache.allocate(rows)  # in flight together: neither is cached yet
    cache.commit(a, rows)
    cache.commit(b, rows)
    assert cache.stats["cached_pages"] == 2
    cache.release(b)  # b's pages were never registered: all go back to the pool
    assert pool.num_free_pages == 16 - len(a.pages)
    cache.release(a)
    assert pool.num_free_pages == 14
