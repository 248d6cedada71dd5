r"""A stream's states in an engine, and the chunks it emits.

A stream is one client request, addressed by its stream id (Triton's correlation id):

    QUEUED -> (WAITING_KV: D only, the KV is crossing) -> RUNNING -> FINISHED
                     \-> FAILED (transfer failed, engine fault)     \-> CANCELLED (client went away)

Only the engine that owns a stream mutates it. Everything the client sees leaves through its
`ChunkSink`: `emit(chunk)` per group of rows (the last with `final=True`) or exactly one
`fail(error)`; after either terminal call the sink is never used again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

import numpy as np
import torch

from tandem.backend.codec.base import CodecWindow, FrameTrack
from tandem.backend.errors import TandemError
from tandem.backend.generation.sampling import SamplingParams
from tandem.backend.timing import Timings


class StreamStatus(IntEnum):
    QUEUED = 0
    WAITING_KV = 1
    RUNNING = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5


@dataclass(frozen=True)
class Chunk:
    """Rows generated since the previous chunk of the same stream.

    rows: int64 [N, W]; first_row: index of rows[0] among the stream's generated rows; final: the
    stream ends with this chunk; timings: the stream's per-stage timestamps (renderers send them with
    the final chunk); window: the codec frames (with their context) whose audio this chunk carries
    (backend/codec/base.py): the vocoder decodes it and nothing else, so it stays stateless.
    """

    rows: np.ndarray
    first_row: int
    final: bool
    timings: Timings | None = None
    window: CodecWindow | None = None


class ChunkSink(Protocol):
    def emit(self, chunk: Chunk) -> None:
        """Called by the owning engine thread, in order; the last call has chunk.final set."""

    def fail(self, error: TandemError) -> None:
        """Called at most once, instead of a final chunk."""

    def cancelled(self) -> bool:
        """True when the client has gone away; the engine then frees the stream's resources."""


@dataclass
class Stream:
    stream_id: int
    prompt_len: int
    sampling: SamplingParams
    max_new_rows: int
    sink: ChunkSink
    timings: Timings
    eos_token_id: int | None = None
    status: StreamStatus = StreamStatus.QUEUED
    pages: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None  # slot of every position this stream may use
    generated: list[np.ndarray] = field(default_factory=list)  # one [W] row per generated position
    emitted_rows: int = 0
    chunk_index: int = 0
    chunk_rows: int = 0  # rows the next chunk waits for, chosen when the previous one left
    playing_since_s: float | None = None  # engine clock at the first sounding chunk (the listener's start)
    left: bool = False  # D: set once when the stream stopped counting as a member and gave pages back
    held_pages: list[int] | None = None  # D, direct mode: pages a failed transfer may still write
    seen: torch.Tensor | None = None  # Bool [W, V] on the pool's device: ids generated (repetition penalty)
    frames: FrameTrack | None = None  # the stream's codec frames, set when it joins a decode batch

    @property
    def position(self) -> int:
        """Position of the most recent generated row (its KV is written by the next decode step)."""
        return self.prompt_len + len(self.generated) - 1


@dataclass
class EngineRequest:
    """A validated request as an engine receives it (prompt already checked and packed)."""

    stream_id: int
    prompt: np.ndarray  # int64 [T, W], C-contiguous
    sampling: SamplingParams
    max_new_rows: int
    sink: ChunkSink
    timings: Timings
    received_s: float = 0.0  # time.monotonic() at engine receipt, for the bounded admission wait
