"""P's and the monolithic engine's scheduler (`backend/scheduling/prefill_plan.py`): a plan is data,
so each test states a queue and the pool's pages and asserts what one forward takes and why the next
prompt waits."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from tandem.backend.errors import PoolExhausted
from tandem.backend.kv.layout import KVLayout
from tandem.backend.kv.pool import KVPool
from tandem.backend.kv.prefix_cache import PrefixCache, PrefixLookup
from tandem.backend.scheduling.prefill_plan import PrefillPlan, Wait, plan_prefill
from tandem.backend.settings import BatchSettings

LIMITS = BatchSettings(prefill_batch_max=4, prefill_batch_rows=100)


def prompt(rows: int, cached: int = 0, pages: int = 1, first: bytes | None = None, hits=()) -> PrefixLookup:
    return PrefixLookup(rows, cached, first, pages, frozenset(hits))


def test_an_empty_queue_plans_nothing() -> None:
    assert plan_prefill([], 100, LIMITS) == PrefillPlan(take=0, rows=0, waits=None)


def test_a_forward_takes_at_most_prefill_batch_max_prompts() -> None:
    queue = [prompt(10, first=bytes([i])) for i in range(6)]
    assert plan_prefill(queue, 100, LIMITS) == PrefillPlan(4, 40, Wait.BATCH_FULL)
    assert plan_prefill(queue[:4], 100, LIMITS) == PrefillPlan(4, 40, None)  # nobody waits
    assert plan_prefill(queue, 100, BatchSettings(prefill_batch_max=0)).take == 1  # one at least


def test_rows_beyond_prefill_batch_rows_wait_but_a_long_prompt_runs_alone() -> None:
    assert plan_prefill([prompt(60), prompt(50)], 100, LIMITS) == PrefillPlan(1, 60, Wait.ROWS)
    assert plan_prefill([prompt(300), prompt(5)], 100, LIMITS) == PrefillPlan(1, 300, Wait.ROWS)
    # rows a prefix-cache hit covers cost nothing: 60 + (80 - 48) rows to compute
    assert plan_prefill([prompt(60), prompt(80, cached=48)], 100, LIMITS) == PrefillPlan(2, 92, None)


def test_a_prompt_whose_first_page_another_member_computes_waits_for_the_next_forward() -> None:
    voice = b"voice"
    same = [prompt(20, first=voice), prompt(21, first=voice), prompt(22, first=b"other")]
    assert plan_prefill(same, 100, LIMITS) == PrefillPlan(1, 20, Wait.SAME_VOICE)  # arrival order kept
    cached = [prompt(20, cached=16, first=voice), prompt(21, cached=16, first=voice)]
    assert plan_prefill(cached, 100, LIMITS) == PrefillPlan(2, 9, None)  # a hit for both: no wait


def test_pages_the_pool_cannot_give_make_the_prompt_wait() -> None:
    queue = [prompt(10, pages=6), prompt(10, pages=5), prompt(10, pages=1)]
    assert plan_prefill(queue, 10, LIMITS) == PrefillPlan(1, 10, Wait.PAGES)
    assert plan_prefill(queue, 11, LIMITS) == PrefillPlan(2, 20, Wait.PAGES)
    assert plan_prefill(queue, 12, LIMITS) == PrefillPlan(3, 30, None)
    assert plan_prefill(queue, 5, LIMITS) == PrefillPlan(0, 0, Wait.PAGES)


def test_evictable_cached_pages_a_member_shares_are_pinned_once() -> None:
    """Two prompts sharing evictable cached pages 1 and 2: the first pins them (they leave what the
    pool can evict), the second shares them without pinning them again."""
    shared = [prompt(40, cached=32, pages=2, hits={1, 2}), prompt(40, cached=32, pages=2, hits={1, 2})]
    assert plan_prefill(shared, 6, LIMITS).take == 2  # 2 + 2 pinned, then 2
    assert plan_prefill(shared, 5, LIMITS) == PrefillPlan(1, 8, Wait.PAGES)
    assert plan_prefill(shared[:1], 3, LIMITS) == PrefillPlan(0, 0, Wait.PAGES)  # 2 new + 2 pinned > 3


def test_the_monolithic_engines_room_bounds_the_forward() -> None:
    queue = [prompt(10, first=bytes([i])) for i in range(3)]
    assert plan_prefill(queue, 100, LIMITS, room=0) == PrefillPlan(0, 0, Wait.ROOM)
    assert plan_prefill(queue, 100, LIMITS, room=2) == PrefillPlan(2, 20, Wait.ROOM)
    assert plan_prefill(queue, 100, LIMITS, room=3) == PrefillPlan(3, 30, None)


def test_the_queue_is_read_no_further_than_the_prompt_that_waits() -> None:
    """Each lookup hashes a prompt's pages: a long queue behind a full forward costs nothing."""
    read = itertools.count()
    queue = (prompt(10, first=bytes([next(read)])) for _ in range(100))
    assert plan_prefill(queue, 100, LIMITS).take == 4
    assert next(read) == 5  # four taken, the fifth read to say why it waits


LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=(n, 2), dtype=np.int64)


@pytest.mark.parametrize("num_pages", range(4, 16))
def test_a_plan_over_real_lookups_is_what_the_cache_then_allocates(num_pages: int) -> None:
    """The plan's page rule against the real allocator: with cached voices on the evictable list,
    every planned prompt's `allocate` succeeds in order, and where the plan says PAGES the next one's
    raises PoolExhausted."""
    pool = KVPool(LAYOUT, num_pages=num_pages, page_size=4, device="cpu")
    cache = PrefixCache(pool)
    voice = _rows(9, 0)  # two full pages, cached and then evictable
    warm = cache.allocate(voice)
    cache.commit(warm, voice)
    cache.release(warm)
    prompts = [np.concatenate([voice, _rows(3 + i, 10 + i)]) for i in range(3)] + [_rows(7, 20), _rows(5, 21)]
    plan = plan_prefill(
        (cache.lookup(p, extra_tokens=4) for p in prompts), cache.available_pages, BatchSettings()
    )
    allocs = [cache.allocate(p, extra_tokens=4) for p in prompts[: plan.take]]
    assert sum(a.cached_tokens for a in allocs) == 8 * min(plan.take, 3)
    if plan.waits is Wait.PAGES:
        with pytest.raises(PoolExhausted):
            cache.allocate(prompts[plan.take], extra_tokens=4)
    else:
        assert plan == PrefillPlan(5, sum(p.shape[0] for p in prompts) - 8 * 3, None)
