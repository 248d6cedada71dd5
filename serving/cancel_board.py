"""Cancellations of `tts` streams, posted to D by stream id, read by every D stub of the unit.

Why: Triton 2.51 checks a cancelled ensemble request only between its steps and never marks the
`decode` step's request cancelled, so a client that hangs up on `tts` left D decoding the stream to
its `MAX_TOKENS` into a closed stream (docs/failure-semantics.md, "Client cancellation"). A client
that knows its stream id (the Triton `sequence_id` it chose) tells D directly: one request to the
`decode` model with the `CANCEL` input (INT64 [1], the stream id) and no `HANDOFF`.

Who calls: the `decode` stub that Triton hands such a request `post`s the id (whichever D instance
the sequence batcher picks, which need not be the stream's); every D stub asks `posted` for each of
its pending streams in the poll that already forwards Triton's own cancellations
(`serving/engine_worker.py`, every 0.5 s), and the one that holds the stream sends its engine a
Cancel (the engine drops the stream and frees its pages, as for `tts_mono`).

Memory: one empty file per posting in `<unit control dir>/cancels/` (0700, the unit's own, beside its
sockets). A posting that arrives before its stream reaches D (still in P) waits for it; every posting
is removed once used or after `ttl_s` (60 s), so a later stream that reuses an id is not cancelled.
Failure: a board that cannot be written makes the CANCEL request fail with its error; reading
failures count as "not posted" (the stream then runs to its end, as before).

The stream id is the capability: a client that can reach the unit's gRPC port and guess an id can
cancel that stream, so ids should be random (the gateway's are 63 random bits; TTSClient's default
pid-and-counter ids are guessable). Past MAX_POSTINGS the board refuses more (BoardFull).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("tandem")

TTL_S = 60.0  # a posting no D stub has used by then is removed
READ_EVERY_S = 0.25  # the listing is read at most this often, however many streams ask
MAX_POSTINGS = 4096  # a flood of CANCELs is refused past this (each D poll reads every posting)


class BoardFull(OSError):
    """The board holds MAX_POSTINGS postings: the CANCEL request is refused (UNAVAILABLE)."""


class CancelBoard:
    """One D stub's view of the unit's board (module docstring). Any thread."""

    def __init__(self, directory: Path, ttl_s: float = TTL_S) -> None:
        self.directory = directory
        self._ttl_s = ttl_s
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)
        self._lock = threading.Lock()
        self._names: frozenset[str] = frozenset()
        self._read_at = -1.0

    def post(self, stream_id: int) -> None:
        """Cancel `stream_id` wherever it is on D (now, or when it arrives within `ttl_s`). Raises
        ValueError for an id that is not positive, BoardFull past MAX_POSTINGS."""
        if stream_id <= 0:
            raise ValueError(f"CANCEL = {stream_id}: a stream id is a positive sequence_id")
        if len(os.listdir(self.directory)) >= MAX_POSTINGS:
            raise BoardFull(f"the cancel board holds {MAX_POSTINGS} postings (each lives {self._ttl_s:g} s)")
        path = self.directory / str(stream_id)
        path.touch(mode=0o600)
        os.utime(path)  # a repeated posting starts its ttl again
        with self._lock:
            self._read_at = -1.0  # the next `posted` reads the listing again

    def posted(self, stream_id: int) -> bool:
        """Whether `stream_id` has a cancellation posted; a True is used up (the posting removed)."""
        name = str(stream_id)
        with self._lock:
            now = time.monotonic()
            if now - self._read_at >= READ_EVERY_S:
                self._names = frozenset(self._read())
                self._read_at = now
            if name not in self._names:
                return False
            self._names = self._names - {name}
        try:
            (self.directory / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # used all the same: the ttl sweep or another stub removes it
            log.warning("cancel board: posting %s not removed: %s", name, exc)
        return True

    def _read(self) -> list[str]:
        """The postings younger than the ttl; older ones are removed."""
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            log.warning("cancel board %s cannot be read: %s", self.directory, exc)
            return []
        now, fresh = time.time(), []
        for entry in entries:
            try:
                if now - entry.stat().st_mtime > self._ttl_s:
                    os.unlink(entry.path)
                    continue
            except FileNotFoundError:  # used or swept by another D stub meanwhile
                continue
            except OSError as exc:  # counted as posted; swept later
                log.warning("cancel board: %s: %s", entry.path, exc)
            fresh.append(entry.name)
        return fresh
