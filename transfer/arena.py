"""Byte-range allocator for D's receive arena.

The arena is one block of memory P can write (for the host path a memfd both processes map). Each
transfer gets a region: a 4 KiB-aligned range, first fit over a sorted free list, coalesced on free.
The allocator knows nothing of quarantine — the receiver simply does not call `free` until it holds a
proof — so a leak check is `free_bytes == capacity` once every handle is finished.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

ALIGN = 4096


@dataclass(frozen=True)
class Region:
    """A byte range [offset, offset + alloc_bytes) of the arena; the transfer uses its first `nbytes`."""

    offset: int
    nbytes: int
    alloc_bytes: int


class RegionAllocator:
    """Thread-safe first-fit allocator over [0, capacity)."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if capacity <= 0 or capacity % align:
            raise ValueError(f"arena capacity {capacity} must be a positive multiple of {align}")
        self.capacity = capacity
        self.align = align
        self._starts: list[int] = [0]  # sorted starts of free ranges
        self._lengths: dict[int, int] = {0: capacity}
        self._live: dict[int, int] = {}  # offset -> alloc_bytes of allocated regions
        self._lock = threading.Lock()

    def allocate(self, nbytes: int) -> Region | None:
        """First free range that fits `nbytes` rounded up to the alignment, or None if none does.

        Called by `TransferReceiver.request` once per transfer. The region belongs to the caller until
        it passes it to `free` exactly once.
        """
        if nbytes <= 0:
            raise ValueError("region size must be positive")
        size = -(-nbytes // self.align) * self.align
        with self._lock:
            for i, start in enumerate(self._starts):
                length = self._lengths[start]
                if length < size:
                    continue
                del self._lengths[start]
                if length == size:
                    del self._starts[i]
                else:
                    self._starts[i] = start + size
                    self._lengths[start + size] = length - size
                self._live[start] = size
                return Region(offset=start, nbytes=nbytes, alloc_bytes=size)
        return None

    def free(self, region: Region) -> None:
        """Return a region. Raises on a double free (an internal invariant, never a peer's doing)."""
        with self._lock:
            size = self._live.pop(region.offset, None)
            if size is None or size != region.alloc_bytes:
                raise AssertionError(f"double or foreign free of {region}")
            start, end = region.offset, region.offset + size
            i = bisect.bisect_left(self._starts, start)
            if i < len(self._starts) and self._starts[i] == end:  # merge with the next range
                end += self._lengths.pop(end)
                del self._starts[i]
            if i > 0:
                prev = self._starts[i - 1]
                if prev + self._lengths[prev] == start:  # merge with the previous range
                    self._lengths[prev] = end - prev
                    return
            self._starts.insert(i, start)
            self._lengths[start] = end - start

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(self._lengths.values())

    @property
    def live_count(self) -> int:
        with self._lock:
            return len(self._live)
