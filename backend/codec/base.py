"""The codec seam: a stream's rows -> codec frames (on D) -> audio (in the vocoder), statelessly.

A neural codec's audio for a frame depends on its neighbours (SNAC's decoder is convolutional), so
audio for frames [a, b) needs frames a - lookback .. b + lookahead as context. The vocoder must stay
stateless per request (Triton may run chunks of many streams interleaved), so D sends the context
with every chunk: D's per-stream `FrameTrack` turns the rows it generated into frames and, for each
chunk, cuts a `CodecWindow`: the frames [first_frame, first_frame + N) to decode and the range
[emit_from, emit_to) whose audio this chunk carries. Consecutive windows of a stream emit
consecutive ranges from frame 0 (the first frame's audio is never dropped), so the client's audio is
the offline decode of the whole code sequence up to the context's truncation:
- a frame is emitted once `lookahead` frames after it exist, or when the stream ends (the offline
  decode has no frames after the last one either); a trailing partial frame makes no sound;
- a window starts `lookback` frames before its first emitted frame (none before frame 0, like the
  offline decode).
With SNAC 24 kHz (random weights, noise off) lookback 2 / lookahead 1 measured 53 dB SNR against the
offline decode, lookahead 2 about 92 dB, lookahead 0 about 31 dB (docs/codecs.md).

Who owns what: `FrameTrack` belongs to the stream's engine thread; a `CodecWindow` is immutable and
owns its `frames` array; a `Codec` (the vocoder's) keeps no per-stream state.
This module imports no torch: D's chunk emission and the spec reading need none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class CodecSpec:
    """What the rest of the system needs to know of a codec, without loading it.

    rows_per_frame: LM rows per codec frame (Orpheus: 7 with row width 1; the reference codec: 1).
    rows_per_second is real time in LM rows (tokens for W = 1): sample_rate / samples_per_frame *
    rows_per_frame, e.g. Orpheus 24000 / 2048 * 7 = 82.03125. The rate floor is this over the RTF target.
    """

    kind: str
    layout: str
    sample_rate: int
    samples_per_frame: int
    rows_per_frame: int
    lookback: int
    lookahead: int

    def __post_init__(self) -> None:
        if min(self.sample_rate, self.samples_per_frame, self.rows_per_frame) < 1:
            raise ValueError(f"codec {self.kind}: sample rate, samples and rows per frame must be >= 1")
        if self.lookback < 0 or self.lookahead < 0:
            raise ValueError(f"codec {self.kind}: lookback and lookahead frames must be >= 0")

    @property
    def rows_per_second(self) -> float:
        return self.sample_rate / self.samples_per_frame * self.rows_per_frame


def format_rate(value: float) -> str:
    """A rate as published in config parameters: '21' for whole numbers, else '82.03125'."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


@dataclass(frozen=True)
class CodecWindow:
    """Frames [first_frame, first_frame + N) of one stream and the range [emit_from, emit_to) whose
    audio a chunk carries. frames: int64 [N, K] in the codec's canonical order, owned by the window.
    Invariant: first_frame <= emit_from <= emit_to <= first_frame + N."""

    frames: np.ndarray
    first_frame: int
    emit_from: int
    emit_to: int

    def __post_init__(self) -> None:
        if self.frames.ndim != 2:
            raise ValueError(f"window frames must be [N, K], got shape {list(self.frames.shape)}")
        end = self.first_frame + self.frames.shape[0]
        if not (0 <= self.first_frame <= self.emit_from <= self.emit_to <= end):
            raise ValueError(
                f"window emits frames [{self.emit_from}, {self.emit_to}) outside its frames "
                f"[{self.first_frame}, {end})"
            )

    @property
    def emitted(self) -> int:
        return self.emit_to - self.emit_from

    @property
    def first_sounding(self) -> bool:
        """The stream's first window that sounds: it starts at frame 0 and emits frames (the one
        whose audio stamps `first_audio`)."""
        return self.emit_from == 0 and self.emitted > 0

    def as_array(self) -> np.ndarray:
        """(first_frame, emit_from, emit_to) as int64 [3], the `WINDOW` tensor D sends."""
        return np.array([self.first_frame, self.emit_from, self.emit_to], dtype=np.int64)

    @classmethod
    def from_arrays(cls, frames: np.ndarray, window: np.ndarray) -> CodecWindow:
        """The inverse of (`frames`, `as_array()`); raises ValueError for a malformed pair."""
        w = np.asarray(window).reshape(-1)
        if w.shape[0] != 3 or w.dtype.kind not in "iu":
            raise ValueError(f"WINDOW must be 3 integers, got {w.dtype} {list(w.shape)}")
        f = np.asarray(frames)
        if f.dtype.kind not in "iu":
            raise ValueError(f"CODES must be integers, got {f.dtype}")
        return cls(f.astype(np.int64, copy=False), int(w[0]), int(w[1]), int(w[2]))


class Codec(Protocol):
    """Decodes windows of codec frames to PCM; the vocoder's (and the monolithic engine's) codec.

    Stateless across calls: the audio of a window depends on nothing but the window (and, for a codec
    whose config asks for decoder noise, on that noise).
    """

    @property
    def spec(self) -> CodecSpec: ...

    def decode(self, windows: list[CodecWindow]) -> list[np.ndarray]:
        """Audio of each window's emitted frames: a new float32 [emitted * samples_per_frame] array in
        [-1, 1] per window, in order. Windows of many streams go through in as few device calls as
        their shapes allow. Raises ValueError for a window this codec cannot decode (wrong frame
        width, codes out of range)."""
        ...


class Encoder(Protocol):
    """A codec's encoder: audio -> frames, the inverse direction of `Codec.decode`. Registered voices
    (`backend/voices/registrar.py`) encode a reference recording once with it."""

    @property
    def spec(self) -> CodecSpec: ...

    def encode(self, pcm: np.ndarray, frame_width: int) -> np.ndarray:
        """Frames of `pcm` (float32 mono at `spec.sample_rate`, read only): a new int64 [F, K] array
        in the codec's canonical order, K = `frame_width` (the layout's codes per frame, for codecs
        whose frame width follows the model's rows). Raises ValueError for a width it cannot make."""
        ...


class AudioLayout(Protocol):
    """How a model's generated rows carry codec frames (backend/codec/orpheus.py, `RowLayout`)."""

    name: str
    rows_per_frame: int

    def frame_width(self, row_width: int) -> int:
        """Codes per frame for rows of `row_width` ids."""
        ...

    def codes(self, rows: np.ndarray, audio_index: int) -> np.ndarray:
        """Flat int64 codes of the audio in `rows` [N, W] (read only), `audio_index` codes having come
        before; frame f is codes [f*K, (f+1)*K) of the stream."""
        ...

    def codec_order(self, frames: np.ndarray) -> np.ndarray:
        """Frames [F, K] as the layout emits them -> the codec's canonical order (a new array)."""
        ...


class RowLayout:
    """Each row is one frame of its W ids (the reference codec, and any codec without interleave)."""

    name = "rows"
    rows_per_frame = 1

    def frame_width(self, row_width: int) -> int:
        return row_width

    def codes(self, rows: np.ndarray, audio_index: int) -> np.ndarray:
        return np.asarray(rows, dtype=np.int64).reshape(-1)

    def codec_order(self, frames: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(frames)


@dataclass(frozen=True)
class Framing:
    """D's side of a codec: its layout and context. `track` starts one stream's `FrameTrack`."""

    layout: AudioLayout
    lookback: int = 0
    lookahead: int = 0

    def track(self, row_width: int) -> FrameTrack:
        return FrameTrack(self, row_width)


class FrameTrack:
    """One stream's codes on D and what of them has been sent as audio.

    Called only by the stream's engine thread: `push` with each chunk's new rows, then `window`
    once for that chunk. Memory: the stream's codes (int64), grown by doubling.
    """

    def __init__(self, framing: Framing, row_width: int) -> None:
        self._framing = framing
        self._k = framing.layout.frame_width(row_width)
        self._codes = np.empty(self._k * 16, dtype=np.int64)
        self._n = 0
        self.emitted = 0  # frames whose audio has been sent

    @property
    def frames(self) -> int:
        """Complete frames so far."""
        return self._n // self._k

    def push(self, rows: np.ndarray) -> None:
        new = self._framing.layout.codes(rows, self._n)
        need = self._n + new.shape[0]
        if need > self._codes.shape[0]:
            grown = np.empty(max(need, 2 * self._codes.shape[0]), dtype=np.int64)
            grown[: self._n] = self._codes[: self._n]
            self._codes = grown
        self._codes[self._n : need] = new
        self._n = need

    def window(self, final: bool) -> CodecWindow:
        """The window for the chunk whose rows were just pushed; `final`: the stream ends with it, so
        every complete frame is emitted. Advances `emitted`."""
        f = self.frames
        emit_to = f if final else max(self.emitted, f - self._framing.lookahead)
        emit_from = self.emitted
        if emit_to == emit_from:  # nothing to sound yet: send no frames at all
            return CodecWindow(np.empty((0, self._k), dtype=np.int64), emit_from, emit_from, emit_from)
        start = max(0, emit_from - self._framing.lookback)
        raw = self._codes[start * self._k : f * self._k].reshape(-1, self._k)
        self.emitted = emit_to
        return CodecWindow(self._framing.layout.codec_order(raw), start, emit_from, emit_to)
