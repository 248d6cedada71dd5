"""Compressed formats and speed for streamed audio: FFmpeg's encoders, muxers and `atempo` through PyAV.

- `Encoder(fmt, sample_rate)`: float32 mono PCM in, as it comes, the container's bytes out as
  soon as the muxer writes them: `mp3` (LAME, MPEG audio frames), `opus` (libopus in Ogg, 48 kHz:
  the model's PCM is resampled by soxr, Ogg pages of at most `OGG_PAGE_MS`), `aac` (FFmpeg's AAC
  in ADTS frames), `flac` (a native FLAC stream; its STREAMINFO cannot be rewritten on a stream, so
  it gives no total length). Each codec takes fixed-size frames: samples wait until a frame is full;
  `finish()` sends the short last frame and the encoder's tail. Decoded, each gives the PCM's
  samples plus the codec's own padding (LAME's and AAC's priming frames).
- `Tempo(sample_rate, speed)`: `speed` in [0.25, 4.0] by FFmpeg's `atempo` (WSOLA: time-stretch,
  pitch kept), chained for speed < 0.5 (one `atempo` takes [0.5, 100]); streamed, `finish()` drains it.

Who calls: `audio.Framer` (one of each per response). Not thread-safe; CPU work on the event loop
in small pieces (a response's audio at a time; an mp3 of 1 s of 24 kHz audio takes ~2 ms).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
import soxr
from av.audio.stream import AudioStream

SPEED_MIN, SPEED_MAX = 0.25, 4.0
OGG_PAGE_MS = 60  # an Ogg page's most audio: the opus stream's latency and ~4 kbit/s of page headers


@dataclass(frozen=True)
class Codec:
    container: str  # FFmpeg's muxer
    codec: str  # FFmpeg's encoder
    sample_format: str  # one the encoder takes
    rate: int | None = None  # None: the PCM's own rate
    options: tuple[tuple[str, str], ...] = ()  # the muxer's


CODECS = {
    "mp3": Codec("mp3", "libmp3lame", "fltp"),
    "opus": Codec("ogg", "libopus", "flt", 48000, (("page_duration", str(OGG_PAGE_MS * 1000)),)),
    "aac": Codec("adts", "aac", "fltp"),
    "flac": Codec("flac", "flac", "s16"),
}


class _Sink:
    """The muxer's output file: keeps what it is given until taken (no seek: a stream)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


def _samples(pcm: np.ndarray, sample_format: str) -> np.ndarray:
    x = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    if sample_format.startswith("s16"):
        return (x * 32767.0).round().astype(np.int16)
    return x


class Encoder:
    """One streamed file of `fmt` (a key of CODECS) from mono PCM at `sample_rate`. `whole`: the
    file is given out once, by `finish`, from a seekable buffer, so the muxer can go back and write
    what it learns at the end (FLAC's STREAMINFO: the total samples and the MD5)."""

    def __init__(self, fmt: str, sample_rate: int, whole: bool = False) -> None:
        spec = CODECS[fmt]
        self.spec = spec
        self.rate = spec.rate or sample_rate
        self._resample = (
            soxr.ResampleStream(sample_rate, self.rate, 1, dtype="float32")
            if self.rate != sample_rate
            else None
        )
        self._sink = _Sink()
        self._whole = io.BytesIO() if whole else None
        out = self._whole if self._whole is not None else self._sink
        self._out = av.open(out, mode="w", format=spec.container, options=dict(spec.options))
        stream = self._out.add_stream(spec.codec, rate=self.rate)
        assert isinstance(stream, AudioStream)
        stream.layout = "mono"
        stream.format = spec.sample_format
        stream.codec_context.open()
        self._stream = stream
        self._frame = stream.codec_context.frame_size or 1024
        self._pending = np.zeros(0, dtype=np.float32)
        self._pts = 0

    def encode(self, pcm: np.ndarray) -> bytes:
        """float32 PCM in [-1, 1]; returns the bytes the muxer wrote (possibly none yet)."""
        x = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if self._resample is not None:
            x = self._resample.resample_chunk(x)
        self._pending = np.concatenate([self._pending, x])
        n = len(self._pending) // self._frame * self._frame
        for i in range(0, n, self._frame):
            self._send(self._pending[i : i + self._frame])
        self._pending = self._pending[n:]
        return self._sink.take()  # empty when whole: `finish` gives the file

    def finish(self) -> bytes:
        """The last short frame, the encoder's delayed packets and the container's trailer."""
        if self._resample is not None:
            self._pending = np.concatenate(
                [self._pending, self._resample.resample_chunk(np.zeros(0, np.float32), last=True)]
            )
        if len(self._pending):
            self._send(self._pending)
            self._pending = self._pending[:0]
        for packet in self._stream.encode(None):
            self._out.mux(packet)
        self._out.close()
        return self._whole.getvalue() if self._whole is not None else self._sink.take()

    def _send(self, x: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(
            _samples(x, self.spec.sample_format)[None, :], format=self.spec.sample_format, layout="mono"
        )
        frame.sample_rate = self.rate
        frame.pts = self._pts
        self._pts += len(x)
        for packet in self._stream.encode(frame):
            self._out.mux(packet)


def atempo_chain(speed: float) -> list[float]:
    """`speed` as `atempo` factors each in [0.5, 4.0] whose product is `speed`."""
    if not SPEED_MIN <= speed <= SPEED_MAX:
        raise ValueError(f"speed = {speed:g}: outside [{SPEED_MIN:g}, {SPEED_MAX:g}]")
    factors = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    return [*factors, speed]


class Tempo:
    """`speed` x faster mono float32 PCM at `sample_rate`, pitch kept, streamed."""

    def __init__(self, sample_rate: int, speed: float) -> None:
        self.rate = sample_rate
        self._graph = av.filter.Graph()
        node = self._graph.add_abuffer(
            format="flt", sample_rate=sample_rate, layout="mono", time_base=Fraction(1, sample_rate)
        )
        for factor in atempo_chain(speed):
            nxt = self._graph.add("atempo", f"{factor:.6f}")
            node.link_to(nxt)
            node = nxt
        sink = self._graph.add("abuffersink")
        node.link_to(sink)
        self._graph.configure()
        self._pts = 0

    def push(self, pcm: np.ndarray) -> np.ndarray:
        x = np.asarray(pcm, dtype=np.float32).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self._pts
        self._pts += x.shape[1]
        self._graph.push(frame)
        return self._pull()

    def finish(self) -> np.ndarray:
        self._graph.push(None)
        return self._pull()

    def _pull(self) -> np.ndarray:
        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            out.append(frame.to_ndarray().reshape(-1))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
