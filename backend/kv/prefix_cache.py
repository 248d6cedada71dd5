"""Automatic prefix caching over prompt rows (TTS prompts repeat long prefixes: a voice's rows).

Page i of a prompt is keyed by a hash chain, key_i = H(key_{i-1}, rows of page i), so a key names
the page's rows and everything before them. Only full pages are cached, and a cached page is never
written again. Pages carry reference counts; a cached page nobody uses stays on an LRU list until
`allocate` needs free pages. The last prompt token is always recomputed (its logits are needed).

One engine thread calls every method; there is no locking.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.backend.errors import PoolExhausted
from tandem.backend.kv.pool import KVPool

_ROOT = b"tandem-prefix-v1"


@dataclass
class PrefixAllocation:
    """Pages backing one prompt (plus its decode room); owned by the engine until `PrefixCache.release`."""

    pages: list[int]  # all pages backing the prompt's tokens (cached ones first)
    cached_tokens: int  # number of leading prompt tokens whose KV is already in the pool
    n_tokens: int  # total tokens this allocation covers
    released: bool = field(default=False, repr=False)


@dataclass(frozen=True)
class PrefixLookup:
    """What `allocate` would do for one prompt now, nothing allocated: what a prefill plan reads."""

    rows: int  # the prompt's rows
    cached_tokens: int  # leading tokens served from the cache
    first_page: bytes | None  # key of the prompt's first full page (None: shorter than one page + 1)
    new_pages: int  # fresh pages it would take (prompt and extra tokens, less the cached pages)
    evictable_hits: frozenset[int]  # cached pages it would share that are evictable now (it pins them)


def _as_rows(rows: torch.Tensor | np.ndarray) -> np.ndarray:
    arr = rows.detach().cpu().numpy() if isinstance(rows, torch.Tensor) else np.asarray(rows)
    if arr.ndim != 2 or arr.shape[0] < 1:
        raise ValueError(f"prompt rows must be a non-empty [T, W] array, got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


class PrefixCache:
    """Hands out pool pages for prompts, reusing pages that already hold a prompt's leading full pages."""

    def __init__(self, pool: KVPool, enabled: bool = True) -> None:
        """Called once by an engine; the cache then owns every page it holds on the LRU list."""
        self.pool = pool
        self.enabled = enabled
        self._key_to_page: dict[bytes, int] = {}
        self._page_key: dict[int, bytes] = {}
        self._refs: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0, oldest first
        self._hit_tokens = 0
        self._miss_tokens = 0
        self._evictions = 0

    def _keys(self, rows: np.ndarray, n_pages: int) -> list[bytes]:
        size = self.pool.page_size
        parent = _ROOT + rows.shape[1].to_bytes(4, "little")
        keys = []
        for i in range(n_pages):
            parent = hashlib.blake2b(
                parent + rows[i * size : (i + 1) * size].tobytes(), digest_size=16
            ).digest()
            keys.append(parent)
        return keys

    def lookup(self, rows: torch.Tensor | np.ndarray, extra_tokens: int = 0) -> PrefixLookup:
        """`allocate(rows, extra_tokens)` as it would go now, allocating, evicting and counting nothing:
        for planning a prefill forward (`backend/scheduling/prefill_plan.py`)."""
        arr = _as_rows(rows)
        n_prompt = arr.shape[0]
        max_pages = (n_prompt - 1) // self.pool.page_size  # never the whole prompt
        keys = self._keys(arr, max_pages) if self.enabled else []
        matched: list[int] = []
        for key in keys:
            page = self._key_to_page.get(key)
            if page is None:
                break
            matched.append(page)
        return PrefixLookup(
            rows=n_prompt,
            cached_tokens=len(matched) * self.pool.page_size,
            first_page=keys[0] if keys else None,
            new_pages=self.pool.pages_for(n_prompt + extra_tokens) - len(matched),
            evictable_hits=frozenset(p for p in matched if p in self._lru),
        )

    @property
    def available_pages(self) -> int:
        """Free pool pages plus evictable cached pages: what `allocate` could hand out right now."""
        return self.pool.num_free_pages + len(self._lru)

    def allocate(self, rows: torch.Tensor | np.ndarray, extra_tokens: int = 0) -> PrefixAllocation:
        """Pages for prompt `rows` [T, W] plus room for `extra_tokens` more tokens.

        Called by the prefill/monolithic engine at admission. Leading full pages that are cached are shared
        (their KV is valid, `cached_tokens` says how many tokens); the rest are fresh pages the caller must
        fill. The caller owns the allocation until `release`. Raises PoolExhausted with nothing leaked and
        nothing evicted when the pool cannot cover the request even after evicting.
        """
        arr = _as_rows(rows)
        n_prompt = arr.shape[0]
        n_total = n_prompt + extra_tokens
        matched: list[int] = []
        if self.enabled:
            max_pages = (n_prompt - 1) // self.pool.page_size  # never the whole prompt
            for key in self._keys(arr, max_pages):
                page = self._key_to_page.get(key)
                if page is None:
                    break
                matched.append(page)
        need = self.pool.pages_for(n_total) - len(matched)
        evictable = len(self._lru) - sum(1 for p in matched if p in self._lru)
        if need > self.pool.num_free_pages + evictable:
            raise PoolExhausted(
                f"prompt of {n_prompt} rows (+{extra_tokens}) needs {need} new KV pages; "
                f"{self.pool.num_free_pages} free, {evictable} evictable"
            )
        for page in matched:
            self._refs[page] = self._refs.get(page, 0) + 1
            self._lru.pop(page, None)
        self._evict(need - self.pool.num_free_pages)
        fresh = self.pool.allocate(need)
        for page in fresh:
            self._refs[page] = 1
        cached = len(matched) * self.pool.page_size
        self._hit_tokens += cached
        self._miss_tokens += n_prompt - cached
        return PrefixAllocation(pages=matched + fresh, cached_tokens=cached, n_tokens=n_total)

    def _evict(self, n_pages: int) -> None:
        for _ in range(max(0, n_pages)):
            page, _unused = self._lru.popitem(last=False)
            del self._key_to_page[self._page_key.pop(page)]
            self.pool.free([page])
            self._evictions += 1

    def commit(self, alloc: PrefixAllocation, rows: torch.Tensor | np.ndarray) -> None:
        """Register the prompt's full pages so later prompts can share them.

        Called by the engine after the prefill forward wrote KV for all T prompt rows into `alloc.pages`.
        From here on those pages are read-only. A page whose content another allocation already registered
        stays private to `alloc` (and returns to the pool on release).
        """
        if not self.enabled or alloc.released:
            return
        arr = _as_rows(rows)
        if arr.shape[0] > alloc.n_tokens:
            raise ValueError("commit rows exceed the allocation")
        for page, key in zip(alloc.pages, self._keys(arr, arr.shape[0] // self.pool.page_size), strict=False):
            if key in self._key_to_page or page in self._page_key:
                continue
            self._key_to_page[key] = page
            self._page_key[page] = key

    def release(self, alloc: PrefixAllocation) -> None:
        """Drop this allocation's references. Called by the engine when the sequence ends (any way).

        Uncached pages return to the pool; cached pages whose count drops to zero stay cached on the LRU
        list. Releasing twice raises ValueError.
        """
        if alloc.released:
            raise ValueError("allocation released twice")
        alloc.released = True
        to_free: list[int] = []
        # Deepest pages first onto the LRU, so eviction takes leaves before the prefixes they hang from.
        for page in reversed(alloc.pages):
            count = self._refs[page] - 1
            if count:
                self._refs[page] = count
                continue
            del self._refs[page]
            if page in self._page_key:
                self._lru[page] = None
            else:
                to_free.append(page)
        self.pool.free(to_free)

    @property
    def stats(self) -> dict[str, int]:
        """Counters for metrics: hit/miss prompt tokens, cached/evictable pages, evictions."""
        return {
            "hit_tokens": self._hit_tokens,
            "miss_tokens": self._miss_tokens,
            "cached_pages": len(self._page_key),
            "evictable_pages": len(self._lru),
            "evictions": self._evictions,
        }
