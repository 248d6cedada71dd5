"""Rows of codec ids -> PCM audio: the CPU default's codec.

The decode engine emits one row of `row_width` ids per step; the vocoder turns finished rows into
audio in chunks as they arrive. The seam is `backend/codec/base.py` (`Codec`: windows of frames -> audio,
with context frames sent by D); `ReferenceVocoder` below is the CPU default's codec: one frame per
row and no context needed, so the streaming path, its tests and its benchmarks run without model
weights. SNAC (backend/codec/snac.py) sits behind the same seam.

Chunking contract: `synthesize` is a pure function of (rows, first_row). Audio for rows a..b-1
followed by audio for rows b..c-1 is the audio for rows a..c-1, so chunk sizes (`ChunkPolicy`,
backend/codec/chunking.py) are a latency/overhead trade-off only and never change what the client hears.
"""

from __future__ import annotations

import os
import wave
from typing import Protocol

import numpy as np

from tandem.backend.codec.base import CodecSpec, CodecWindow

# re-exported: bench/decode_loop.py and older callers import it from here
from tandem.backend.codec.chunking import ChunkPolicy as ChunkPolicy
from tandem.backend.codec.config import VocoderConfig


class Vocoder(Protocol):
    """Turns rows of a stream into audio; called by the streaming engine once per chunk.

    Implementations must be stateless across calls (or keep state that makes the output depend on
    nothing but the arguments): the engine may resend a chunk after a retry, skip ahead after a
    cancel, or run chunks of different streams interleaved.
    """

    @property
    def sample_rate(self) -> int: ...

    @property
    def samples_per_row(self) -> int: ...

    def synthesize(self, rows: np.ndarray, first_row: int) -> np.ndarray:
        """Audio for rows `first_row .. first_row + N - 1` of a stream.

        Args:
            rows: int64 [N, W] codec ids; read only, the caller keeps ownership.
            first_row: absolute index of rows[0] in the stream (>= 0).

        Returns:
            A new float32 [N * samples_per_row] mono array in [-1, 1], owned by the caller.
        """
        ...


# Tones span two octaves of whole-hertz frequencies from A3 (see ReferenceVocoder).
_BASE_HZ = 220.0
_SEMITONES = 24
_LEVELS = 8
_HEADROOM = 0.9  # peak amplitude: the sum of a row's partials never exceeds this


class ReferenceVocoder:
    """A deterministic, cheap stand-in for a neural codec decoder.

    Each row becomes a short chord: column c's id picks a pitch (one of 24 semitones, shifted up
    c octaves) and a loudness level; the partials are summed and scaled so the peak stays below
    0.9. Frequencies are whole hertz and the phase is taken from the absolute sample index modulo
    the sample rate in integer arithmetic, so the waveform is exact at any stream position (no float
    drift after hours) and chunk boundaries are seamless. Each row fades in and out over a short
    raised-cosine edge so pitch changes between rows do not click.

    Cost: O(N * W * samples_per_row) numpy work, about a millisecond per second of audio.
    """

    def __init__(self, cfg: VocoderConfig, edge_ms: float = 5.0) -> None:
        self._cfg = cfg
        spr = cfg.samples_per_row
        edge = max(1, min(spr // 2, round(cfg.sample_rate * edge_ms / 1000.0)))
        ramp = 0.5 - 0.5 * np.cos(np.pi * (np.arange(edge) + 0.5) / edge)
        window = np.ones(spr)
        window[:edge] = ramp
        window[spr - edge :] = np.minimum(window[spr - edge :], ramp[::-1])
        self._window = window
        nyquist = cfg.sample_rate // 2
        self._semitone_hz = np.rint(_BASE_HZ * 2.0 ** (np.arange(_SEMITONES) / 12.0)).astype(np.int64)
        if int(self._semitone_hz[-1]) >= nyquist:
            raise ValueError(f"sample_rate {cfg.sample_rate} is too low for the reference vocoder's tones")
        self._nyquist = nyquist

    @property
    def sample_rate(self) -> int:
        return self._cfg.sample_rate

    @property
    def samples_per_row(self) -> int:
        return self._cfg.samples_per_row

    @property
    def spec(self) -> CodecSpec:
        """As a `Codec`: one frame per row, no context (each row's audio depends on it alone)."""
        return CodecSpec("reference", "rows", self.sample_rate, self.samples_per_row, 1, 0, 0)

    def decode(self, windows: list[CodecWindow]) -> list[np.ndarray]:
        """`Codec.decode`: each window's emitted frames are rows; their audio is `synthesize`'s."""
        out = []
        for w in windows:
            lo = w.emit_from - w.first_frame
            out.append(self.synthesize(w.frames[lo : lo + w.emitted], w.emit_from))
        return out

    def encode(self, pcm: np.ndarray, frame_width: int) -> np.ndarray:
        """`Encoder.encode`, the analysis `synthesize` inverts: each row-long frame of `pcm`, for each
        column c, is projected (windowed, as synthesized) onto column c's 24 candidate tones; the
        strongest gives the semitone and its amplitude the level. Rows of one column this codec made
        come back exactly; with more columns, whose two-octave ranges overlap, a tone can be read
        into its neighbour's column (the mapping is not injective), and any other audio becomes the
        rows whose tones are nearest it. Deterministic. int64 [F, frame_width], ids < 192."""
        spr, sr, width = self.samples_per_row, self.sample_rate, frame_width
        n = pcm.shape[0] // spr
        if width < 1:
            raise ValueError(f"frame_width must be >= 1, got {width}")
        frames = np.asarray(pcm[: n * spr], dtype=np.float64).reshape(n, spr) * self._window
        octave = np.arange(width, dtype=np.int64) % 3
        hz = self._semitone_hz[None, :] << octave[:, None]  # [W, 24]
        hz = np.where(hz < self._nyquist, hz, hz >> octave[:, None])
        t = np.arange(spr, dtype=np.float64)
        basis = np.exp(-2j * np.pi * hz[:, :, None] * t / sr) * self._window  # [W, 24, spr]
        mags = np.abs(np.einsum("fs,wks->fwk", frames, basis)) * 2.0 / float(np.sum(self._window**2))
        semitone = np.argmax(mags, axis=2)  # [F, W]
        amp = np.take_along_axis(mags, semitone[:, :, None], axis=2)[:, :, 0] / (_HEADROOM / width)
        level = np.clip(np.rint((amp - 0.25) / 0.75 * (_LEVELS - 1)), 0, _LEVELS - 1).astype(np.int64)
        return level * _SEMITONES + semitone

    def synthesize(self, rows: np.ndarray, first_row: int) -> np.ndarray:
        """See `Vocoder.synthesize`. Raises ValueError for non-2-D or non-integer rows, or first_row < 0."""
        if rows.ndim != 2 or rows.dtype.kind not in "iu":
            raise ValueError(f"rows must be an integer [N, W] array, got {rows.dtype} {list(rows.shape)}")
        if first_row < 0:
            raise ValueError(f"first_row must be >= 0, got {first_row}")
        n, width = rows.shape
        spr = self.samples_per_row
        sr = self.sample_rate
        ids = rows.astype(np.int64, copy=False)
        octave = np.arange(width, dtype=np.int64) % 3  # keep high columns below the Nyquist frequency
        hz = self._semitone_hz[ids % _SEMITONES] << octave  # [N, W] whole hertz
        hz = np.where(hz < self._nyquist, hz, hz >> octave)
        level = (ids // _SEMITONES) % _LEVELS  # [N, W]
        amp = (0.25 + 0.75 * level / (_LEVELS - 1)) * (_HEADROOM / width)
        # Absolute sample index of every output sample: this is what makes chunking invisible.
        t = (first_row * spr + np.arange(n * spr, dtype=np.int64)).reshape(n, 1, spr)
        cycles = (hz[:, :, None] * t) % sr  # exact integer phase, in units of 1/sr of a cycle
        tone = np.sin(cycles * (2.0 * np.pi / sr))  # [N, W, spr]
        pcm = np.einsum("nw,nws->ns", amp, tone) * self._window
        return pcm.astype(np.float32).reshape(-1)


def write_wav(path: str | os.PathLike[str], pcm: np.ndarray, sample_rate: int) -> None:
    """Write mono float PCM in [-1, 1] as a 16-bit WAV file (samples outside the range are clipped)."""
    if pcm.ndim != 1:
        raise ValueError(f"pcm must be 1-D mono, got shape {list(pcm.shape)}")
    samples = np.rint(np.clip(pcm.astype(np.float64), -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(os.fspath(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(samples.tobytes())
