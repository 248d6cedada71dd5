"""D's proof that a transfer's pages hold what P sent: the checksum of what landed.

Called by a reader thread once per DONE, with no receiver lock held. The memory it hashes is the
transfer's (state DONE): nothing of D's touches it before VERIFIED, and P's copy ended before its
DONE. The caller compares the result with P's checksum; a mismatch fails the transfer.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .checksum import format_checksum, kv_checksum, kv_checksum_rows
from .handle import TransferHandle
from .paths.base import LocalArena


class Verifier:
    """Hashes a region of `arena` (region mode) or the destination rows of `pool` (direct mode)."""

    def __init__(self, arena: LocalArena, pool: torch.Tensor | None) -> None:
        self._arena = arena
        self._pool = pool
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def checksum(self, h: TransferHandle) -> str:
        """The formatted checksum of what landed for `h`. On a GPU it runs on a stream of its own:
        on the thread's default stream it would queue behind the engine's decode steps."""
        if self._pool is not None and h.dest is not None:  # direct: the rows in D's pool, in place
            with self._stream(self._pool.device):
                dest = torch.from_numpy(h.dest).to(self._pool.device)
                return format_checksum(kv_checksum_rows(self._pool, dest))
        region = self._arena.region_bytes(h.region)
        with self._stream(region.device):
            return format_checksum(kv_checksum(region))

    def _stream(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        if device.type != "cuda":
            return contextlib.nullcontext()
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                # High priority: the hash is on every new stream's path to its first audio, and the
                # engine's decode steps would otherwise keep the device's SMs ahead of it.
                stream = self._streams[device] = torch.cuda.Stream(device=device, priority=-1)
        return torch.cuda.stream(stream)
