"""The prompts one prefill forward takes, decided: shared by P and the monolithic engine.

`plan_prefill` reads the queued prompts in arrival order, each as the prefix cache would serve it now
(`PrefixLookup`: nothing allocated), and the pages the pool could hand out, and returns a
`PrefillPlan`: how many prompts at the head of the queue one forward (`Decoder.prefill_many`) takes,
and why the next one waits. It runs nothing; the engine reserves the plan's pages, runs the forward
and hands each prompt on (`backend/engines/prefill_run.py`).

The rules, for each prompt in order; the first that breaks one waits, and every prompt behind it
(arrival order):
- room (the monolithic engine only): no more prompts than the running batch has free places;
- size: at most `prefill_batch_max` prompts (one at least) and, beside a first one, at most
  `prefill_batch_rows` rows to compute (rows a prefix-cache hit covers cost nothing; a longer
  prompt runs alone);
- same voice: a prompt whose first page another member computes (not cached yet) waits for the next
  forward, where it is a prefix-cache hit instead of the same prefix computed twice;
- pages: its fresh pages (the monolithic engine: with its decode room, `extra_tokens` of its lookup)
  from what the pool has free or can evict, less the evictable cached pages members before it pin.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.backend.kv.prefix_cache import PrefixLookup
from tandem.backend.settings import BatchSettings


class Wait(enum.Enum):
    """Why the prompt after a plan's last waits for a later forward."""

    ROOM = "the running batch has no free place"
    BATCH_FULL = "the forward holds prefill_batch_max prompts"
    ROWS = "its rows would take the forward past prefill_batch_rows"
    SAME_VOICE = "another member computes its first page"
    PAGES = "the pool cannot give it its pages"


@dataclass(frozen=True)
class PrefillPlan:
    """One forward: the queue's first `take` prompts, in order; `rows` to compute in all; `waits`:
    why prompt `take` waits (None: the queue ended)."""

    take: int
    rows: int
    waits: Wait | None


def plan_prefill(
    queue: Iterable[PrefixLookup], available_pages: int, limits: BatchSettings, room: int | None = None
) -> PrefillPlan:
    """The forward over the head of `queue` (each queued prompt's lookup, in arrival order; read
    lazily, up to the first that waits). `available_pages`: free plus evictable pages
    (`PrefixCache.available_pages`); `room`: the running batch's free places (None: no running batch,
    as on P)."""
    take = rows = 0
    free = available_pages
    pinned: set[int] = set()
    computing: set[bytes] = set()  # first pages this forward computes (not cached yet)
    for p in queue:
        if room is not None and take >= room:
            return PrefillPlan(take, rows, Wait.ROOM)
        if take >= max(1, limits.prefill_batch_max):
            return PrefillPlan(take, rows, Wait.BATCH_FULL)
        new_rows = p.rows - p.cached_tokens
        if take and rows + new_rows > limits.prefill_batch_rows:
            return PrefillPlan(take, rows, Wait.ROWS)
        if take and p.first_page in computing:
            return PrefillPlan(take, rows, Wait.SAME_VOICE)
        pins = p.evictable_hits - pinned
        if p.new_pages > free - len(pins):
            return PrefillPlan(take, rows, Wait.PAGES)
        free -= p.new_pages + len(pins)
        pinned |= pins
        if p.cached_tokens == 0 and p.first_page is not None:
            computing.add(p.first_page)
        take += 1
        rows += new_rows
    return PrefillPlan(take, rows, None)
