"""A reference recording as uploaded -> mono float32 PCM at the codec's rate, or a clear refusal.

Decoding is FFmpeg's, through PyAV (`av.open` on the bytes: WAV, FLAC, MP3, Ogg/Opus, AAC, ... any
container and codec the wheel's FFmpeg reads); PyAV's resampler makes packed (interleaved) float at
the file's own rate and layout, the channels' mean is the mono signal, and soxr (HQ) changes the rate
to the codec's: a kept resampler whose stop-band holds ~136 dB where FFmpeg's default gives ~27 dB near
Nyquist. Packed, not planar: PyAV 18 reports 9 planes for a planar frame of 8 or more channels and
`AudioFrame.to_ndarray()` then reads past the frame and crashes the process; a packed frame is one
plane whatever its channel count. A reference has at most `MAX_CHANNELS` channels (7.1); more is
refused before anything is resampled. The registrar runs this in a child process of its own
(`decoder_process.py`), so a native crash that still gets through fails one registration only.

Every refusal is `InvalidInput` naming AUDIO (the gateway's `file`): not audio, no audio stream,
more than `MAX_CHANNELS` channels, unreadable mid-way, shorter than `min_seconds`, longer than
`max_seconds` (the container's header duration is checked first, so a 10-minute file is refused
before it is decoded; the header can lie, so decoding also stops at the limit), silent. Runs in the
registrar's decode child (`decoder_process.py`), never on a Triton stub: decoding 30 s costs tens of
ms.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np
import soxr

from tandem.backend.errors import InvalidInput

MAX_CHANNELS = 8  # 7.1; a voice reference is mono or stereo, and no more is ever needed to mix one
SILENCE_PEAK = 1e-4  # a reference whose every sample is below this (-80 dBFS) carries no voice


@dataclass(frozen=True)
class Reference:
    """The decoded recording: `pcm` float32 mono at `sample_rate` (the codec's), and the file's own
    rate and duration."""

    pcm: np.ndarray
    sample_rate: int
    source_rate: int
    duration_s: float


def decode_reference(data: bytes, sample_rate: int, min_seconds: float, max_seconds: float) -> Reference:
    """Decode `data` (a whole audio file) to mono float32 at `sample_rate`. Raises InvalidInput."""
    if not data:
        raise InvalidInput("AUDIO is empty: send the reference recording's file")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise InvalidInput(f"AUDIO is not an audio file FFmpeg can read ({_reason(exc)})") from None
    with container:
        if not container.streams.audio:
            raise InvalidInput(f"AUDIO holds no audio stream (a {container.format.name} file)")
        stream = container.streams.audio[0]
        rate = int(stream.rate or stream.codec_context.sample_rate or 0)
        if rate <= 0:
            raise InvalidInput("AUDIO has no sample rate")
        _check_channels(stream.codec_context.channels)
        if container.duration is not None and container.duration / av.time_base > max_seconds + 1:
            seconds = container.duration / av.time_base
            raise InvalidInput(f"AUDIO is {seconds:.1f} s long; the longest reference is {max_seconds:g} s")
        pcm = _decode_mono(container, stream, rate, max_seconds)
    seconds = pcm.shape[0] / rate
    if seconds < min_seconds:
        raise InvalidInput(f"AUDIO is {seconds:.2f} s long; the shortest reference is {min_seconds:g} s")
    if seconds > max_seconds:
        raise InvalidInput(
            f"AUDIO is over {max_seconds:g} s long; the longest reference is {max_seconds:g} s"
        )
    if float(np.max(np.abs(pcm))) < SILENCE_PEAK:
        raise InvalidInput("AUDIO is silent")
    out = pcm if rate == sample_rate else soxr.resample(pcm, rate, sample_rate, quality="HQ")
    return Reference(np.ascontiguousarray(out, dtype=np.float32), sample_rate, rate, seconds)


def _reason(exc: Exception) -> str:
    """What FFmpeg says is wrong, without PyAV's errno and '<none>' file name (`[Errno 1094995529]
    Invalid data found when processing input: '<none>'` says "Invalid data found when processing
    input")."""
    if isinstance(exc, (av.error.FFmpegError, OSError)) and exc.strerror:
        return str(exc.strerror)
    return str(exc) or type(exc).__name__


def _decode_mono(
    container: av.container.InputContainer, stream: av.AudioStream, rate: int, limit_s: float
) -> np.ndarray:
    """Every sample of `stream` mixed to mono float32 at its own rate; stops once past `limit_s`."""
    # Packed float at the file's own layout (module docstring), then the mean of its channels:
    # FFmpeg's own downmix sums channels at -3 dB each, which lifts a centred stereo voice by 3 dB
    # and can clip it.
    mixer = av.AudioResampler(format="flt", layout=stream.layout, rate=rate)
    parts: list[np.ndarray] = []
    total, cap = 0, int(limit_s * rate) + rate  # a second past the limit is enough to refuse it
    try:
        for frame in container.decode(stream):
            _check_channels(frame.layout.nb_channels)  # a stream may change its layout mid-way
            for mixed in mixer.resample(frame):
                part = _mono(mixed)
                parts.append(part)
                total += part.shape[0]
            if total > cap:
                break
        else:
            for mixed in mixer.resample(None):
                parts.append(_mono(mixed))
    except (av.error.FFmpegError, ValueError) as exc:
        raise InvalidInput(f"AUDIO is unreadable: {_reason(exc)}") from None
    if not parts:
        raise InvalidInput("AUDIO holds no samples")
    pcm = np.concatenate(parts).astype(np.float32, copy=False)
    if not np.all(np.isfinite(pcm)):
        raise InvalidInput("AUDIO holds samples that are not finite numbers")
    return pcm


def _check_channels(channels: int) -> None:
    if not 0 < channels <= MAX_CHANNELS:
        raise InvalidInput(f"AUDIO has {channels} channels; a reference has 1 to {MAX_CHANNELS}")


def _mono(frame: av.AudioFrame) -> np.ndarray:
    """A packed float frame's channels averaged: its one plane is [samples x channels] interleaved."""
    channels = frame.layout.nb_channels
    return frame.to_ndarray().reshape(-1, channels).mean(axis=1)
