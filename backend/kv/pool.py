"""Paged, per-token KV storage shared by every sequence one engine runs.

One tensor `[L, 2, slots, kvh, hd]` cut into fixed-size pages; a sequence owns a list of pages in any
order, each of its tokens one slot, and attention reads K/V by slot. `gather`/`scatter` of a whole
sequence (what the P -> D hand-off moves) is one row copy each over the token axis (the
`tandem.csrc.kv_cuda` kernels on a GPU, torch on the CPU; bit-for-bit the same).

The free list is a LIFO stack (the most recently freed page first). Allocation and free are not
locked: each engine calls them from one thread, or (D) under its one lock (docs/architecture.md,
"D's engine").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.backend.device import upload
from tandem.backend.errors import PoolExhausted
from tandem.backend.kv.layout import KVLayout
from tandem.csrc import kv_cuda


class KVPool:
    """Paged per-token KV storage. kv: Tensor[num_layers, 2, num_pages*page_size, num_kv_heads, head_dim]
    (layer-major; a 'slot' is one token row; page p owns slots p*page_size .. p*page_size+page_size-1)."""

    kv: torch.Tensor
    layout: KVLayout
    num_pages: int
    page_size: int
    device: torch.device

    def __init__(
        self,
        layout: KVLayout,
        num_pages: int,
        page_size: int,
        device: torch.device | str,
        storage: torch.Tensor | None = None,
    ) -> None:
        """Called once by an engine at start-up; the pool owns `kv` for its whole life. `storage` (D in
        direct mode: the receiver's arena, which P writes) is used as `kv` instead of a fresh tensor and
        must be `layout.staging_shape(num_pages * page_size)`, of the layout's dtype, on `device`. Either
        way it is zero-filled, so masked reads of never-written slots cannot bring NaN/Inf into attention."""
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        shape = layout.staging_shape(num_pages * page_size)
        if storage is None:
            self.kv = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        else:
            d = storage.device
            if (
                tuple(storage.shape) != shape
                or storage.dtype != layout.dtype
                or d.type != self.device.type
                or (self.device.index is not None and d.index != self.device.index)
            ):
                raise ValueError(
                    f"pool storage is {tuple(storage.shape)} {storage.dtype} on {storage.device}, "
                    f"expected {shape} {layout.dtype} on {self.device}"
                )
            self.kv = storage
            self.kv.zero_()
            if self.kv.is_cuda:  # another process writes this memory, ordered on nothing of ours
                torch.cuda.synchronize(self.kv.device)
        # Stack: pop() hands out the last element, so store pages in reverse to start with page 0.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free: list[bool] = [True] * num_pages

    def randomize(self, generator: torch.Generator) -> None:
        """Fill every slot with N(0, 1) in the stored units (benches and D's calibration: never time on
        zeros). Layer by layer, so the temporaries stay small; an E4M3 pool draws in bfloat16 and
        converts (torch draws no float8)."""
        for layer in range(self.kv.shape[0]):
            if self.kv.dtype == torch.float8_e4m3fn:
                draw = torch.empty(self.kv.shape[1:], dtype=torch.bfloat16, device=self.kv.device)
                self.kv[layer].copy_(draw.normal_(0.0, 1.0, generator=generator))
            else:
                self.kv[layer].normal_(0.0, 1.0, generator=generator)

    @property
    def num_free_pages(self) -> int:
        """Pages not owned by anyone; admission control compares this with `pages_for(...)`."""
        return len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        """Pages needed to hold `n_tokens` tokens (ceil division)."""
        if n_tokens < 0:
            raise ValueError("n_tokens must be >= 0")
        return -(-n_tokens // self.page_size)

    def allocate(self, n_pages: int) -> list[int]:
        """Take `n_pages` free pages; the caller owns them until it passes them to `free`.

        Raises PoolExhausted without taking any page when fewer than `n_pages` are free.
        """
        if n_pages < 0:
            raise ValueError("n_pages must be >= 0")
        if n_pages > len(self._free):
            raise PoolExhausted(f"asked for {n_pages} KV pages, {len(self._free)} free of {self.num_pages}")
        if n_pages == 0:
            return []
        pages = self._free[-n_pages:]
        del self._free[-n_pages:]
        pages.reverse()
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return pages to the pool; ownership ends here. Their contents are left as they are.

        Validates the whole call first (ValueError on out-of-range, already-free or repeated pages),
        so a bad call frees nothing. A later `allocate` hands these pages out in the order given.
        """
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self.num_pages:
                raise ValueError(f"page {p} out of range [0, {self.num_pages})")
            if self._is_free[p] or p in seen:
                raise ValueError(f"page {p} freed twice")
            seen.add(p)
        for p in pages:
            self._is_free[p] = True
        self._free.extend(reversed(pages))

    def slot_array(self, pages: Sequence[int], n_tokens: int) -> np.ndarray:
        """`slots` as a host int64 array: no torch call, no device. D's admission thread uses it (a
        device copy there would wait for the running step and for the GIL, docs/benchmarks)."""
        if n_tokens > len(pages) * self.page_size:
            raise ValueError(f"{n_tokens} tokens do not fit in {len(pages)} pages of {self.page_size}")
        page_a = np.asarray(pages, dtype=np.int64)
        return (page_a[:, None] * self.page_size + np.arange(self.page_size, dtype=np.int64)).reshape(-1)[
            :n_tokens
        ]

    def slots(self, pages: Sequence[int], n_tokens: int) -> torch.Tensor:
        """Slot of each of the first `n_tokens` tokens stored in `pages` (in order), on the pool's device.

        Returns a fresh LongTensor[n_tokens] the caller owns.
        """
        return self.slots_to_device(self.slot_array(pages, n_tokens))

    def slots_to_device(self, arr: np.ndarray) -> torch.Tensor:
        """A host slot array on the pool's device, ordered on the current stream (after the work
        already queued there, before what follows). On a GPU the copy goes through pinned memory, so
        the host does not wait for it (from pageable memory it would wait for the running step)."""
        return upload(np.asarray(arr, dtype=np.int64), self.device)

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the KV of `slots` (LongTensor[T], contiguous, pool device) into `out`
        (`layout.staging_shape(T)`: contiguous, pool dtype and device; the caller's), ordered on the
        current stream (`kv_cuda.gather`). Slots are not bounds-checked (that would sync the device): they
        must come from `slots()`. Raises ValueError/TypeError on a shape, dtype, device or contiguity
        mismatch; T = 0 copies nothing."""
        if slots.numel() == 0:
            return
        kv_cuda.gather(self.kv, slots, out, check_bounds=False)

    def scatter(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        """Write `src` (`layout.staging_shape(T)`: contiguous, pool dtype and device; the caller's) into the
        pool at `slots` (LongTensor[T], contiguous, pool device), as `gather` with the same checks. Ordered
        on the current stream: work on that stream may reuse `src` at once, a writer ordered on nothing of
        ours (another process) only after the stream passed this point."""
        if slots.numel() == 0:
            return
        kv_cuda.scatter(src, self.kv, slots, check_bounds=False)
