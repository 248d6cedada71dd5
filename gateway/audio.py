"""How the gateway frames streamed audio for an HTTP caller (OpenAI's `response_format` x `stream_format`).

- `pcm`: raw 16-bit signed little-endian mono samples at the model's `sample_rate` (OpenAI's is
  fixed at 24 kHz; here the model's rate is in the `X-Sample-Rate` response header).
- `wav`: a 44-byte RIFF/WAVE header, then the same samples. Asked for without `stream_format`, the
  gateway answers the whole file at once (`Gateway.respond_whole`): the header has the real
  length. Streamed (`stream_format` `audio` or `sse`), the length is unknown when the first bytes go
  out, so both RIFF sizes are 0xFFFFFFFF (the streaming convention players accept); a complete
  file's length is then the bytes received.
- `mp3`, `opus`, `aac`, `flac`: FFmpeg's encoders and muxers through PyAV (`gateway/encode.py`),
  each piece's bytes as the muxer writes them; the response's last bytes come with `end`. A `flac`
  asked for without `stream_format` is answered whole like `wav` (`whole`): its STREAMINFO then has
  the total samples. `X-Sample-Rate` is the rate of what is sent (`output_rate`: Opus 48 kHz).
- `speed` != 1: the PCM goes through FFmpeg's `atempo` (`encode.Tempo`) before any of the above.
- `stream_format=sse`: every piece of the chosen format (the WAV header in the first) is one
  `speech.audio.delta` event with the bytes base64-encoded, then one `speech.audio.done` event with
  OpenAI's `usage` (`input_tokens`: the prompt rows the input made, `output_tokens`: rows
  generated, `total_tokens`); an error after the first audio is an `error` event.
  With `stream_format=audio` the bytes go out as they are (chunked transfer encoding), and an error
  after the first audio ends the response without its terminating chunk (the caller sees a
  truncated body), since the HTTP status has been sent.

Pure functions; `gateway/app.py` calls them.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from tandem.gateway.encode import CODECS, Encoder, Tempo
from tandem.gateway.errors import ClientError


class AudioFormat(str, Enum):
    MP3 = "mp3"
    OPUS = "opus"
    AAC = "aac"
    FLAC = "flac"
    WAV = "wav"
    PCM = "pcm"


class StreamFormat(str, Enum):
    AUDIO = "audio"
    SSE = "sse"


MEDIA_TYPES = {  # what OpenAI answers with
    AudioFormat.MP3: "audio/mpeg",
    AudioFormat.OPUS: "audio/opus",
    AudioFormat.AAC: "audio/aac",
    AudioFormat.FLAC: "audio/flac",
    AudioFormat.WAV: "audio/wav",
    AudioFormat.PCM: "audio/pcm",
}


def pcm16(audio: np.ndarray) -> bytes:
    """float32 PCM in [-1, 1] (clipped) -> 16-bit signed little-endian bytes."""
    clipped = np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def wav_header(sample_rate: int, data_bytes: int = 0xFFFFFFFF) -> bytes:
    """RIFF/WAVE header for mono 16-bit PCM; `data_bytes` unknown (streaming) by default."""
    riff = 0xFFFFFFFF if data_bytes == 0xFFFFFFFF else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )


def _sse(event: dict[str, object]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


@dataclass
class Framer:
    """One response's framing; `first` is True until the first piece went out. `speed`: `atempo`'s
    factor, 1.0 leaves the PCM as it is."""

    audio: AudioFormat
    stream: StreamFormat
    sample_rate: int
    first: bool = True
    speed: float = 1.0
    whole: bool = False  # the encoded file given out whole by `end` (a length in its header: FLAC)
    _tempo: Tempo | None = field(default=None, init=False, repr=False)
    _encoder: Encoder | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.speed != 1.0:
            self._tempo = Tempo(self.sample_rate, self.speed)
        if self.audio.value in CODECS:
            self._encoder = Encoder(self.audio.value, self.sample_rate, whole=self.whole)

    @property
    def output_rate(self) -> int:
        """The rate of the audio the caller gets (`X-Sample-Rate`): the encoder's (Opus: 48 kHz),
        else the PCM's."""
        return self._encoder.rate if self._encoder is not None else self.sample_rate

    @property
    def media_type(self) -> str:
        return "text/event-stream" if self.stream is StreamFormat.SSE else MEDIA_TYPES[self.audio]

    def piece(self, audio: np.ndarray) -> bytes:
        """One piece of PCM as the response's bytes (b"" while an encoder or `atempo` holds it)."""
        if self._tempo is not None:
            audio = self._tempo.push(audio)
        return self._frame(audio)

    def _frame(self, audio: np.ndarray) -> bytes:
        data = self._encoder.encode(audio) if self._encoder is not None else pcm16(audio)
        if self.first and self.audio is AudioFormat.WAV:
            data = wav_header(self.sample_rate) + data
        self.first = False
        if self.stream is StreamFormat.SSE:
            return (
                _sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
                if data
                else b""
            )
        return data

    def end(self, rows: int, input_tokens: int = 0) -> bytes:
        """What `atempo` and the encoder still hold, then (SSE) the `speech.audio.done` event with
        OpenAI's usage: `input_tokens` the prompt rows the input made, `output_tokens` the rows
        generated, `total_tokens` their sum."""
        tail = self._frame(self._tempo.finish()) if self._tempo is not None else b""
        if self._encoder is not None:
            last = self._encoder.finish()
            if self.stream is StreamFormat.SSE and last:
                last = _sse({"type": "speech.audio.delta", "audio": base64.b64encode(last).decode()})
            tail += last
        if self.stream is StreamFormat.SSE:
            usage = {"input_tokens": input_tokens, "output_tokens": rows, "total_tokens": input_tokens + rows}
            return tail + _sse({"type": "speech.audio.done", "usage": usage})
        return tail

    def error(self, err: ClientError) -> bytes | None:
        """The bytes that tell a caller of an error after the first audio; None: end the body instead."""
        if self.stream is StreamFormat.SSE:
            return _sse({"type": "error", "error": {"message": str(err), "code": err.code.value}})
        return None
